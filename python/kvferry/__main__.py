"""python -m kvferry [--socket PATH] [--json] status|stats|ls [--region NAME] [--limit N]

Mirrors the `kvferry` CLI's status, stats and ls for people who live in Python.
"""

from __future__ import annotations

import argparse
import json
import sys

from . import Client, KvferryError, version


def _stats_text(s: dict) -> str:
    occ = 100.0 * s["used_bytes"] / s["capacity_bytes"] if s["capacity_bytes"] else 0.0
    mib = 1048576.0
    return "\n".join(
        [
            f"host pool   {s['used_bytes'] / mib:.1f} of {s['capacity_bytes'] / mib:.1f} MiB used ({occ:.1f}%), "
            + ("page-locked" if s["pool_pinned"] else "pageable"),
            f"blocks      {s['entries']} stored, {s['writing']} being written, {s['pinned']} pinned",
            f"saved       {s['blocks_saved']} blocks, {s['bytes_saved'] / mib:.1f} MiB",
            f"loaded      {s['blocks_loaded']} blocks, {s['bytes_loaded'] / mib:.1f} MiB",
            f"lookups     {s['lookups']} keys: {s['hits']} hits, {s['misses']} misses",
            f"evictions   {s['evictions']} blocks, {s['evicted_bytes'] / mib:.1f} MiB",
            f"checksums   {s['checksum_failures']} damaged blocks caught",
            f"clients     {s['clients']} connected (this one included)",
        ]
    )


def _status_text(s: dict) -> str:
    lines = [f"kvferryd {s['version']}, pid {s['pid']}, up {s['uptime_s']:.1f} s, backend {s['backend']}"]
    lines.append(f"regions: {len(s['regions'])}")
    for r in s["regions"]:
        lines.append(
            f"  {r['id']} {r['name']:<16} {r['layers']} x {r['blocks']} blocks x {r['block_size']} tokens of "
            f"{r['format']}, {r['bytes'] / 1048576.0:.1f} MiB on {r['backend']}, {r['holders']} holder(s)"
            + (", from config" if r["from_config"] else "")
        )
    lines.append(f"clients: {len(s['clients'])}")
    for c in s["clients"]:
        lines.append(f"  {c['id']} {c['name']:<16} pid {c['pid']} uid {c['uid']}, {c['ops']} ops")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvferry", description=__doc__.splitlines()[0])
    ap.add_argument("--socket", help="daemon socket (default: $KVFERRY_SOCKET, else /run/kvferry/kvferry.sock)")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    ap.add_argument("--version", action="store_true", help="print libkvferry's version and exit")
    sub = ap.add_subparsers(dest="cmd")
    sub.add_parser("status", help="the daemon: version, regions, clients")
    sub.add_parser("stats", help="the store's counters")
    lsp = sub.add_parser("ls", help="stored blocks")
    lsp.add_argument("--region", default="", help="only this region's namespace (default: every namespace)")
    lsp.add_argument("--limit", type=int, default=0, help="at most this many (0: what fits)")
    a = ap.parse_args(argv)
    if a.version:
        print(version())
        return 0
    if not a.cmd:
        ap.print_usage(sys.stderr)
        return 2
    try:
        with Client(socket=a.socket, name="python-cli") as c:
            if a.cmd == "status":
                s = c.status()
                print(json.dumps(s) if a.json else _status_text(s))
            elif a.cmd == "stats":
                s = c.stats()
                print(json.dumps(s) if a.json else _stats_text(s))
            else:
                region = c.region(a.region).id if a.region else 0
                rows = c.ls(region, a.limit)
                if a.json:
                    print(json.dumps([dict(r, key=r["key"].hex()) for r in rows]))
                else:
                    print(f"{'NAMESPACE':<40} {'KEY':<32} {'TIER':<5} {'FORMAT':<11} {'BYTES':>10} {'PINS':>4}")
                    for r in rows:
                        print(
                            f"{r['namespace']:<40} {r['key'].hex():<32} {r['tier']:<5} {r['format']:<11} "
                            f"{r['bytes']:>10} {r['pins']:>4}"
                        )
                    print(f"{len(rows)} block(s)")
    except KvferryError as e:
        print(f"python -m kvferry {a.cmd}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

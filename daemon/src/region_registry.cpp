// The region registry: regions made from the configuration or at a client's request, client
// buffers registered as regions, and every lookup, each with its tenant check.
#include "session.h"

#include <algorithm>

namespace kvferry::daemon {

Result<std::shared_ptr<Region>> Daemon::Impl::add_region(const std::string& name, const KvCacheSpec& spec,
                                                         bool from_config, const std::string& owner) {
  uint32_t id;
  {
    std::lock_guard<std::mutex> g(mu);
    id = next_region++;
  }
  auto r = create_region(id, name, spec, backend, cfg.device.gpu);
  if (!r.ok()) return r.status();
  std::lock_guard<std::mutex> g(mu);
  regions[id] = RegionEntry{*r, from_config, 0, owner};
  spdlog::info("region {} '{}': {} x {} blocks x {} tokens of {}, {} bytes on {}, {}", id, name, spec.layers,
               spec.blocks, spec.block_size, spec.format.name(), (*r)->desc().bytes,
               proto::backend_name((*r)->desc().backend), owner.empty() ? "shared" : "owned by '" + owner + "'");
  return r;
}

std::shared_ptr<Region> Daemon::Impl::find_region(const ClientChannel& c, uint32_t id) const {
  std::lock_guard<std::mutex> g(mu);
  auto it = regions.find(id);
  if (it == regions.end()) return nullptr;
  const bool reach = c.admin || it->second.owner.empty() || it->second.owner == c.owner;
  return reach ? it->second.region : nullptr;
}

std::shared_ptr<Region> Daemon::Impl::find_region_for_tenant(const std::string& tenant, uint32_t id) const {
  const std::string owner = owner_of_tenant(tenant);
  std::lock_guard<std::mutex> g(mu);
  auto it = regions.find(id);
  if (it == regions.end()) return nullptr;
  const bool reach = it->second.owner.empty() || it->second.owner == owner;
  return reach ? it->second.region : nullptr;
}

bool Daemon::Impl::Session::visible(const Identity& who, const RegionEntry& e) {
  return who.admin || e.owner.empty() || e.owner == who.owner;
}

Status Daemon::Impl::Session::denied_region(uint32_t rid, const std::string& rname) const {
  return {ErrorCode::kPermissionDenied, "region " + std::to_string(rid) + " '" + rname +
                                            "' belongs to another tenant than '" + ident.owner + "' (" +
                                            creds_text(creds) + ")"};
}

Status Daemon::Impl::Session::send_region(const std::shared_ptr<Region>& r) {
  proto::RegionHandle h;
  h.region = r->desc();
  h.offset = r->offset();  // only a peer's import session is sent a region at an offset
  h.has_ipc_handle = r->ipc_handle(h.ipc_handle);
  const int fd = r->export_fd();
  if (fd >= 0) {
    const int one[1] = {fd};
    return send(proto::encode(h), one);
  }
  return send(proto::encode(h));
}

Status Daemon::Impl::Session::hold_and_send(uint32_t rid, const std::shared_ptr<Region>& r) {
  bool fresh = false;
  {
    std::lock_guard<std::mutex> g(d.mu);
    auto it = d.regions.find(rid);
    if (it == d.regions.end()) return {ErrorCode::kNotFound, "no region with id " + std::to_string(rid)};
    fresh = held.insert(rid).second;
    if (fresh) ++it->second.holders;
  }
  Status st = send_region(r);
  if (!st.ok() && fresh) {
    std::lock_guard<std::mutex> g(d.mu);
    held.erase(rid);
    if (auto it = d.regions.find(rid); it != d.regions.end()) --it->second.holders;
  }
  return st;
}

Status Daemon::Impl::Session::map_region(uint32_t rid) {
  std::shared_ptr<Region> r;
  {
    std::lock_guard<std::mutex> g(d.mu);
    auto it = d.regions.find(rid);
    if (it == d.regions.end()) return {ErrorCode::kNotFound, "no region with id " + std::to_string(rid)};
    if (!visible(ident, it->second)) return denied_region(rid, it->second.region->desc().name);
    if (peer_region && rid != peer_region)
      return {ErrorCode::kPermissionDenied, "a peer daemon's import session maps region " +
                                                std::to_string(peer_region) + " only, not " + std::to_string(rid)};
    r = it->second.region;
  }
  if (r->offset() != 0 && !peer_region)
    return {ErrorCode::kUnsupported, "region '" + r->desc().name + "' was registered at offset " +
                                         std::to_string(r->offset()) +
                                         " inside its buffer; only the client that registered it maps it"};
  return hold_and_send(rid, r);
}

Status Daemon::Impl::Session::check_region_quota(uint64_t bytes, const std::string& rname) const {
  if (ident.admin) return Status::Ok();
  const config::TenantQuota q = d.quota_for(ident);
  uint64_t n = 0, used = 0;
  {
    std::lock_guard<std::mutex> g(d.mu);
    for (auto& [_, e] : d.regions) {
      if (e.from_config || e.owner != ident.owner) continue;
      ++n;
      used += e.region->desc().bytes;
    }
  }
  if (q.regions > 0 && n + 1 > q.regions)
    return {ErrorCode::kResourceExhausted, "region '" + rname + "': tenant '" + ident.owner + "' has its quota of " +
                                               std::to_string(q.regions) +
                                               " regions (quota.regions, default limits.tenant.regions)"};
  if (q.region_bytes > 0 && (bytes > q.region_bytes || used > q.region_bytes - bytes))
    return {ErrorCode::kResourceExhausted, "region '" + rname + "': " + std::to_string(bytes) + " bytes over tenant '" +
                                               ident.owner + "''s quota of " + std::to_string(q.region_bytes) +
                                               " region bytes (" + std::to_string(used) +
                                               " in use; quota.region_bytes, default limits.tenant.region_bytes)"};
  return Status::Ok();
}

Status Daemon::Impl::Session::create_region(const proto::CreateRegion& m) {
  {
    std::shared_ptr<Region> r;
    uint32_t rid = 0;
    {
      std::lock_guard<std::mutex> g(d.mu);
      for (auto& [id2, e] : d.regions) {
        if (e.region->desc().name != m.name) continue;
        if (!visible(ident, e)) return denied_region(id2, m.name);
        const auto& s = e.region->desc().spec;
        if (s.layers != m.spec.layers || s.blocks != m.spec.blocks || s.block_size != m.spec.block_size ||
            s.format != m.spec.format || s.layout != m.spec.layout)
          return {ErrorCode::kAlreadyExists, "region '" + m.name + "' exists with another spec"};
        r = e.region;
        rid = id2;
        break;
      }
    }
    if (r) return hold_and_send(rid, r);
  }
  if (m.spec.validate().ok()) KVFERRY_TRY(check_region_quota(static_cast<uint64_t>(m.spec.region_bytes()), m.name));
  auto r = d.add_region(m.name, m.spec, false, ident.owner);
  if (!r.ok()) return r.status();
  const uint32_t rid = (*r)->desc().id;
  Status st = hold_and_send(rid, *r);
  if (!st.ok()) {
    std::lock_guard<std::mutex> g(d.mu);
    if (auto it = d.regions.find(rid); it != d.regions.end() && it->second.holders == 0) d.regions.erase(it);
  }
  return st;
}

Status Daemon::Impl::Session::register_region(const proto::RegisterRegion& m) {
  const size_t want = m.backend == proto::Backend::kCudaIpc ? 0 : 1;
  if (fds.size() != want)
    return {ErrorCode::kInvalidArgument, "registering region '" + m.name + "' (" +
                                             std::string(proto::backend_name(m.backend)) + ") needs " +
                                             std::to_string(want) + " fd(s), got " + std::to_string(fds.size())};
  {
    std::lock_guard<std::mutex> g(d.mu);
    for (auto& [_, e] : d.regions)
      if (e.region->desc().name == m.name) return {ErrorCode::kAlreadyExists, "a region named '" + m.name + "' exists"};
  }
  uint64_t bytes = m.alloc_bytes;
  if (m.spec.validate().ok()) bytes = std::max(bytes, static_cast<uint64_t>(m.spec.region_bytes()));
  KVFERRY_TRY(check_region_quota(bytes, m.name));
  uint32_t rid;
  {
    std::lock_guard<std::mutex> g(d.mu);
    rid = d.next_region++;
  }
  auto r = import_region(rid, m, want ? std::move(fds[0]) : UniqueFd());
  if (!r.ok()) return r.status();
  proto::RegionHandle h;  // no fd back: the client has its buffer
  h.region = (*r)->desc();
  {
    std::lock_guard<std::mutex> g(d.mu);
    d.regions[rid] = Impl::RegionEntry{*r, false, 1, ident.owner};
    held.insert(rid);
  }
  spdlog::info("client {} registered region {} '{}' for '{}': {} bytes on {}", id, rid, m.name, ident.owner,
               (*r)->desc().bytes, proto::backend_name(m.backend));
  return send(proto::encode(h));
}

Status Daemon::Impl::Session::debug_read(const proto::DebugRead& m) {
  if (!d.cfg.daemon.debug_read)
    return {ErrorCode::kUnsupported, "DebugRead is off on this daemon (daemon.debug_read: false)"};
  std::shared_ptr<Region> r;
  {
    std::lock_guard<std::mutex> g(d.mu);
    auto it = d.regions.find(m.region_id);
    if (it == d.regions.end()) return {ErrorCode::kNotFound, "no region with id " + std::to_string(m.region_id)};
    if (!visible(ident, it->second)) return denied_region(m.region_id, it->second.region->desc().name);
    r = it->second.region;
  }
  std::vector<uint8_t> buf(m.bytes);
  KVFERRY_TRY(r->read(m.offset, buf));
  return send(proto::encode_debug_read_reply(buf));
}

}  // namespace kvferry::daemon

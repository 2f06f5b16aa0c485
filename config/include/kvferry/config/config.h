#pragma once
// kvferry's configuration: plain structs with defaults, filled from YAML through one declarative
// table (key, default, doc, parser, reloadable). Absent key -> default; present but invalid ->
// error naming the key, the file and the line; unknown key -> error suggesting the nearest known key.
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/layouts/kv_cache_spec.h"
#include "kvferry/layouts/status.h"

namespace kvferry::config {

enum class Backend : uint8_t { kAuto = 0, kCuda = 1, kCpu = 2 };
enum class LogLevel : uint8_t { kTrace, kDebug, kInfo, kWarn, kError, kOff };
enum class Checksum : uint8_t { kXxh3 = 0, kNone = 1 };

struct DaemonConfig {
  std::string socket = "/run/kvferry/kvferry.sock";  ///< control socket path
  uint32_t socket_mode = 0660;                       ///< permission bits of the socket file
  std::string group;                                 ///< group owning the socket ("" = daemon's)
  std::vector<uint32_t> allowed_uids;  ///< SO_PEERCRED uids allowed (empty + empty gids = daemon's uid and root)
  std::vector<uint32_t> allowed_gids;  ///< SO_PEERCRED gids allowed
  LogLevel log_level = LogLevel::kInfo;
  std::string metrics_listen = "127.0.0.1:9464";  ///< host:port of /metrics and /healthz ("" = off)
  std::vector<uint32_t> admin_uids{0};            ///< uids that see and manage every tenant (root by default)
  std::vector<uint32_t> admin_gids;               ///< gids (primary or supplementary) that do the same
  bool debug_read = false;                        ///< serve DebugRead (a client reads region bytes through the daemon)

  bool operator==(const DaemonConfig&) const = default;
};

struct DeviceConfig {
  Backend backend = Backend::kAuto;  ///< auto: CUDA when a GPU is usable, else CPU
  int gpu = 0;                       ///< CUDA device index
  bool mps = false;                  ///< the operator runs MPS: the daemon may launch SM kernels

  bool operator==(const DeviceConfig&) const = default;
};

/// A region created at start-up.
struct RegionConfig {
  std::string name;
  KvCacheSpec spec;    ///< layers, blocks, block_size, format, layout
  std::string tenant;  ///< the tenant (of `tenants`) it belongs to; "" = shared by every tenant

  /// KvCacheSpec has no operator==; two regions are equal when name, tenant and every spec field match.
  bool operator==(const RegionConfig& o) const {
    return name == o.name && tenant == o.tenant && spec.layers == o.spec.layers && spec.blocks == o.spec.blocks &&
           spec.block_size == o.spec.block_size && spec.format == o.spec.format && spec.layout == o.spec.layout;
  }
};

struct HostTierConfig {
  uint64_t capacity = uint64_t{1} << 30;  ///< bytes of pinned host pool
  int numa_node = -1;                     ///< -1 = no binding
  double high_watermark = 0.95;           ///< start evicting above this fraction
  double low_watermark = 0.85;            ///< evict down to this fraction

  bool operator==(const HostTierConfig&) const = default;
};

/// When a block written to the disk tier is durable (tiers.disk.durability).
enum class DiskDurability : uint8_t {
  kNone,   ///< no fdatasync: a crash may lose recent blocks (never serves damaged ones)
  kBatch,  ///< one fdatasync per submitted batch before its blocks become visible
  kEach,   ///< one fdatasync per block
};
/// Which I/O engine the disk tier uses (tiers.disk.io_engine).
enum class DiskIoEngine : uint8_t {
  kAuto,   ///< io_uring where the kernel allows it, else pread/pwrite
  kUring,  ///< io_uring (falls back with a log line where refused)
  kPosix,  ///< the pread/pwrite thread pool, always
};

struct DiskTierConfig {
  std::string path;  ///< "" = disk tier off
  uint64_t capacity = 0;
  uint32_t queue_depth = 64;
  bool direct_io = true;
  DiskDurability durability = DiskDurability::kBatch;
  DiskIoEngine io_engine = DiskIoEngine::kAuto;
  bool write_through = false;  ///< saves also write to disk before they complete

  bool operator==(const DiskTierConfig&) const = default;
};

/// When saved blocks go to their remote owners: at save time, or when the host pool evicts them.
enum class RemoteWrite : uint8_t { kThrough, kOnEvict };

struct RemoteTierConfig {
  std::string listen;                             ///< "" = remote tier off; "host:port"
  std::vector<std::string> peers;                 ///< "host:port" of peer daemons (static membership; ids = addresses)
  std::string transport = "tcp";                  ///< UCX_TLS value
  std::string id;                                 ///< member id under etcd ("" = the listen address)
  std::string etcd;                               ///< etcd endpoint http://host:port ("" = static peers)
  std::string prefix = "/kvferry/members/";       ///< the cluster's key prefix in etcd
  std::chrono::milliseconds ttl{10000};           ///< etcd lease TTL (whole seconds)
  std::string secret_file;                        ///< shared key of the cluster ("" = none: loopback only)
  uint32_t replicas = 1;                          ///< owners per block
  std::chrono::milliseconds timeout{5000};        ///< deadline of a remote transfer batch
  std::chrono::milliseconds lookup_timeout{500};  ///< deadline of a remote lookup
  RemoteWrite write = RemoteWrite::kThrough;      ///< through | on_evict
  /// A send into a region of a peer on this host goes region to region (the peer's region
  /// imported once; device-to-device copies for GPU regions), not through the host pools.
  bool local_transfer = true;

  bool operator==(const RemoteTierConfig&) const = default;
};

struct IntegrityConfig {
  Checksum checksum = Checksum::kXxh3;
  bool verify_on_load = true;  ///< verify every block loaded from a lower tier

  bool operator==(const IntegrityConfig&) const = default;
};

/// Per-tenant quotas; 0 in a tenant's own quota = take the `limits.tenant` default.
struct TenantQuota {
  uint32_t clients = 0;         ///< connected clients
  uint32_t regions = 0;         ///< regions created or registered by the tenant
  uint64_t region_bytes = 0;    ///< bytes of those regions
  uint64_t pinned_bytes = 0;    ///< bytes of the tenant's blocks pinned in the host pool
  uint64_t inflight_bytes = 0;  ///< bytes of save/load requests queued or running

  bool operator==(const TenantQuota&) const = default;
};

/// A tenant: the uids and gids (primary or supplementary) that may use it, and its quotas.
/// Regions, blocks and namespaces belong to a tenant; a client sees and touches only its own.
struct TenantConfig {
  std::string name;
  std::vector<uint32_t> uids;
  std::vector<uint32_t> gids;
  TenantQuota quota;  ///< 0 fields = limits.tenant

  bool operator==(const TenantConfig&) const = default;
};

struct LimitsConfig {
  uint32_t max_clients = 64;
  uint32_t ring_entries = 1024;  ///< per-client submission/completion ring slots (power of two)
  std::chrono::milliseconds request_timeout{30000};
  std::chrono::milliseconds watchdog{0};  ///< 0 = take WATCHDOG_USEC from systemd
  /// Default quotas of every tenant (and of every uid where no tenant is configured); here 0 means
  /// no limit, except pinned_bytes: 0 = half of tiers.host.capacity.
  TenantQuota tenant{.clients = 16, .regions = 16, .region_bytes = 0, .pinned_bytes = 0, .inflight_bytes = 0};
  /// A connection without a Hello is closed this long after it was accepted or last answered a
  /// StatusRequest (`kvferry status` connects, asks and leaves well within it).
  std::chrono::milliseconds handshake_timeout{5000};
  /// Connections without a completed Hello at most; more are closed at once.
  uint32_t max_unauthenticated = 64;
  /// A client whose oldest queued control reply is still unsent this long after it was queued
  /// (it does not read its socket) is disconnected.
  std::chrono::milliseconds send_timeout{2000};

  bool operator==(const LimitsConfig&) const = default;
};

struct Config {
  DaemonConfig daemon;
  DeviceConfig device;
  std::vector<RegionConfig> regions;
  HostTierConfig host;      ///< yaml: tiers.host
  DiskTierConfig disk;      ///< yaml: tiers.disk
  RemoteTierConfig remote;  ///< yaml: tiers.remote
  IntegrityConfig integrity;
  LimitsConfig limits;
  std::vector<TenantConfig> tenants;  ///< yaml: tenants (empty = one implicit tenant per uid)

  bool operator==(const Config&) const = default;
};

/// One row of the schema: the dotted key, its default as YAML text, a one-line doc, and whether
/// SIGHUP can apply a change of it to a running daemon.
struct KeyDoc {
  std::string key;
  std::string default_value;
  std::string doc;
  bool reloadable = false;
};

/// The schema, in the order --check-config prints it. The keys of one region appear after
/// "regions" as "regions[].name", "regions[].layers", ... (required ones with default "(required)").
const std::vector<KeyDoc>& schema();

/// Loads and validates a YAML file. Errors (ErrorCode::kConfig) name the file, the line and the
/// key: "kvferry.yaml:12: tiers.host.capacity: '64XB' is not a size (expected e.g. 64GiB)". The
/// text must be one YAML document of at most 1 MiB in UTF-8 without control characters. Never
/// throws. Thread-safe (no shared mutable state).
Result<Config> load_file(const std::string& path);
/// Same from text; `origin` stands for the file name in messages.
Result<Config> load_string(std::string_view yaml, std::string_view origin = "<string>");

/// The effective configuration as YAML (every key, defaults included), for --check-config.
std::string to_yaml(const Config& c);

/// Keys whose value differs between `a` and `b` and that cannot be reloaded (for SIGHUP).
std::vector<std::string> non_reloadable_changes(const Config& a, const Config& b);
/// Keys whose value differs and that can be reloaded.
std::vector<std::string> reloadable_changes(const Config& a, const Config& b);

/// "64GiB", "512MiB", "1.5G", "4096" (bytes) -> bytes. Binary (KiB, MiB, GiB, TiB) and decimal
/// (KB/K, MB/M, GB/G, TB/T) units.
Result<uint64_t> parse_size(std::string_view s);
/// "500ms", "30s", "2m", "1h", "250us" -> duration.
Result<std::chrono::nanoseconds> parse_duration(std::string_view s);

/// Bytes as the shortest exact text parse_size() reads back: "1GiB", "1536MiB", "4097".
std::string format_size(uint64_t bytes);
/// A duration as the shortest exact text parse_duration() reads back: "30s", "500ms", "0s".
std::string format_duration(std::chrono::nanoseconds d);

}  // namespace kvferry::config

#pragma once
// kvferry control-channel wire protocol (DESIGN.md §5).
//
// Every message is a 16-byte header followed by `length` payload bytes:
//   u32 magic 'KVFY' | u16 version | u16 type | u32 length | u32 field_mask
// All integers are little-endian and fixed width. Optional payload fields are present only when
// their bit is set in `field_mask`, so a message grows without a version bump: a reader ignores
// bits it does not know and trailing bytes after the fields it knows. Decoding never trusts a
// length: every read is bounds-checked against the payload and the payload against kMaxPayload.
//
// The data path (ring ops) is described in ring.h; its op codes live here so that one header
// holds every number that crosses a process boundary.
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/layouts/kv_cache_spec.h"
#include "kvferry/layouts/status.h"

namespace kvferry::proto {

inline constexpr uint32_t kMagic = 0x5946564bu;  // "KVFY" as little-endian bytes
inline constexpr uint16_t kVersion = 1;
inline constexpr size_t kHeaderBytes = 16;
/// Largest payload either side accepts; a header announcing more is a protocol error.
inline constexpr uint32_t kMaxPayload = 4u << 20;
/// Largest DebugRead answer.
inline constexpr uint32_t kMaxDebugRead = 1u << 20;

/// Control message types. Values are wire-stable: never renumber, only append.
enum class MsgType : uint16_t {
  kHello = 1,            ///< client -> daemon: first message (client name, pid)
  kWelcome = 2,          ///< daemon -> client: client id, ring geometry, regions; fds: ring, sq/cq eventfds
  kError = 3,            ///< either way: ErrorCode + message; the daemon closes after a protocol error
  kMapRegion = 4,        ///< client -> daemon: region id
  kRegionHandle = 5,     ///< daemon -> client: region + backend handle; fd (memfd / cuMem POSIX fd)
  kCreateRegion = 6,     ///< client -> daemon: name + spec; answered with kRegionHandle
  kStatusRequest = 7,    ///< client -> daemon
  kStatusReply = 8,      ///< daemon -> client: version, uptime, regions, clients
  kDebugRead = 9,        ///< client -> daemon: region, offset, bytes (<= kMaxDebugRead)
  kDebugReadReply = 10,  ///< daemon -> client: the bytes, read through the daemon's own mapping
  kGoodbye = 11,         ///< client -> daemon: orderly disconnect
  kRegisterRegion = 12,  ///< client -> daemon: a buffer the engine allocated; fd or IPC handle
};
inline constexpr uint16_t kMaxMsgType = 12;

/// Ring op codes (SubmitEntry::op). Values are wire-stable. The data ops of the offload/reload
/// work are reserved now so that they slot in without a version bump; until implemented the
/// daemon completes them with ErrorCode::kUnsupported.
enum class Op : uint16_t {
  kPing = 1,  ///< no-op: completes at once with kOk (echoes args[0] into result[0])
  kLookup = 16,
  kSave = 17,
  kLoad = 18,
  kPin = 19,
  kUnpin = 20,
  kEvict = 21,
  kStats = 22,
  kLs = 23,
  kCorruptForTest = 24,  ///< fault knob: flips a stored byte; kUnsupported unless kvferryd --enable-test-faults
  kSend = 25,            ///< save, then write the blocks to a named peer daemon (prefill → decode); remote tier
  kPeers = 26,           ///< the remote tier's members as JSON text; kUnavailable without a remote tier
  kLoadMapped = 27,      ///< load across geometries: (key, region block, part) entries (ops.h)
};
inline constexpr uint16_t kOpTableSize = 64;  ///< ops dispatch through a table of this size

/// Region memory backend.
enum class Backend : uint8_t {
  kMemfd = 0,    ///< host memory, memfd (sealed size), mmap MAP_SHARED
  kCudaVmm = 1,  ///< cuMemCreate allocation exported as a POSIX fd; cuMemMap on import
  kCudaIpc = 2,  ///< cudaMalloc + legacy cudaIpcMemHandle (64 bytes, no fd)
};
std::string_view backend_name(Backend b);

struct Header {
  uint32_t magic = kMagic;
  uint16_t version = kVersion;
  uint16_t type = 0;
  uint32_t length = 0;
  uint32_t field_mask = 0;
};

/// Encodes a header into 16 bytes.
void encode_header(const Header& h, uint8_t out[kHeaderBytes]);
/// Decodes and checks a header: magic, version, known type, length <= kMaxPayload. A wrong
/// version yields kVersionMismatch; anything else malformed kProtocol. Never reads past 16 bytes.
Result<Header> decode_header(std::span<const uint8_t> bytes);

/// Append-only little-endian encoder.
class Writer {
 public:
  void u8(uint8_t v) { buf_.push_back(v); }
  void u16(uint16_t v);
  void u32(uint32_t v);
  void u64(uint64_t v);
  void i64(int64_t v) { u64(static_cast<uint64_t>(v)); }
  void i32(int32_t v) { u32(static_cast<uint32_t>(v)); }
  void str(std::string_view s);  ///< u32 length + bytes
  void bytes(std::span<const uint8_t> b) { buf_.insert(buf_.end(), b.begin(), b.end()); }
  std::vector<uint8_t>& buffer() { return buf_; }

 private:
  std::vector<uint8_t> buf_;
};

/// Bounds-checked little-endian decoder. The first failed read records an error naming the
/// field; later reads return zero. Check ok()/status() once at the end.
class Reader {
 public:
  explicit Reader(std::span<const uint8_t> b) : b_(b) {}
  uint8_t u8(const char* field);
  uint16_t u16(const char* field);
  uint32_t u32(const char* field);
  uint64_t u64(const char* field);
  int64_t i64(const char* field) { return static_cast<int64_t>(u64(field)); }
  int32_t i32(const char* field) { return static_cast<int32_t>(u32(field)); }
  std::string str(const char* field, uint32_t max_len = 4096);
  std::span<const uint8_t> bytes(const char* field, size_t n);
  size_t remaining() const { return b_.size() - pos_; }
  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  void fail(Status s) {
    if (status_.ok()) status_ = std::move(s);
  }

 private:
  bool need(size_t n, const char* field);
  std::span<const uint8_t> b_;
  size_t pos_ = 0;
  Status status_;
};

// ---- messages ----

/// What a client learns about a region.
struct RegionDesc {
  uint32_t id = 0;
  std::string name;
  KvCacheSpec spec;
  uint64_t bytes = 0;        ///< region_bytes() of the spec
  uint64_t alloc_bytes = 0;  ///< bytes of the allocation (>= bytes: granularity rounding)
  Backend backend = Backend::kMemfd;
  int32_t device = -1;  ///< CUDA device, -1 for host memory
};

/// Hello field_mask bits.
inline constexpr uint32_t kFieldNamespace = 1u << 0;  ///< model + tenant follow (the block namespace)
inline constexpr uint32_t kFieldPeerToken = 1u << 1;  ///< a peer daemon's one-time token follows
/// Longest peer token a Hello may carry.
inline constexpr size_t kMaxPeerToken = 64;
struct Hello {
  std::string client_name;
  uint32_t pid = 0;
  /// The client's block namespace: blocks are shared by clients of one model, format family and
  /// tenant, never across. Sent when has_namespace (older clients get the daemon's default).
  bool has_namespace = false;
  std::string model = {};
  std::string tenant = {};
  /// A peer daemon of the remote tier on this host that imports one region for region-to-region
  /// sends: the token that daemon was granted over the cluster's authenticated channel. The
  /// session acts as the token's tenant and may map that region only.
  std::string peer_token = {};
};

struct Welcome {
  uint32_t client_id = 0;
  uint32_t ring_entries = 0;  ///< slots of each ring (power of two)
  uint64_t ring_bytes = 0;    ///< size of the ring memfd (rings + arena)
  uint32_t arena_bytes = 0;   ///< per-client shared arena for block lists
  uint32_t spin_us = 0;       ///< the daemon's spin before it sleeps (informative)
  std::vector<RegionDesc> regions;
};

struct ErrorMsg {
  ErrorCode code = ErrorCode::kInternal;
  std::string message;
};

struct MapRegion {
  uint32_t region_id = 0;
};

/// RegionHandle field_mask bits.
inline constexpr uint32_t kFieldIpcHandle = 1u << 0;  ///< 64-byte cudaIpcMemHandle follows
inline constexpr uint32_t kFieldOffset = 1u << 1;     ///< u64: the region starts this far into the buffer
struct RegionHandle {
  RegionDesc region;
  bool has_ipc_handle = false;
  uint8_t ipc_handle[64] = {};
  /// The region starts this many bytes into the buffer (a KV tensor inside a larger allocation:
  /// CUDA IPC handles and cuMem fds name whole allocations). offset + region bytes <= alloc_bytes.
  uint64_t offset = 0;
};

struct CreateRegion {
  std::string name;
  KvCacheSpec spec;
};

/// An engine's own buffer, exported for the daemon to import. memfd and cuda_vmm buffers travel
/// as one fd (a memfd must be sealed against shrinking); cuda_ipc as a 64-byte handle
/// (field_mask kFieldIpcHandle). Answered with kRegionHandle (without an fd).
struct RegisterRegion {
  std::string name;
  KvCacheSpec spec;
  Backend backend = Backend::kMemfd;
  int32_t device = -1;
  uint64_t alloc_bytes = 0;  ///< bytes of the buffer (>= spec.region_bytes())
  bool has_ipc_handle = false;
  uint8_t ipc_handle[64] = {};
  /// The region starts this many bytes into the buffer (a KV tensor inside a larger allocation:
  /// CUDA IPC handles and cuMem fds name whole allocations). offset + region bytes <= alloc_bytes.
  uint64_t offset = 0;
};

struct StatusReply {
  struct Region {
    RegionDesc desc;
    uint32_t holders = 0;  ///< clients that mapped it
    bool from_config = false;
  };
  struct Client {
    uint32_t id = 0;
    std::string name;
    uint32_t pid = 0, uid = 0;
    uint64_t ops = 0;  ///< ring ops completed
  };
  std::string version;
  uint64_t uptime_ms = 0;
  uint32_t pid = 0;
  std::string backend;
  std::vector<Region> regions;
  std::vector<Client> clients;
};

struct DebugRead {
  uint32_t region_id = 0;
  uint64_t offset = 0;
  uint32_t bytes = 0;
};

/// A whole frame (header + payload) ready to send.
using Frame = std::vector<uint8_t>;

Frame encode(const Hello& m);
Frame encode(const Welcome& m);
Frame encode(const ErrorMsg& m);
Frame encode(const MapRegion& m);
Frame encode(const RegionHandle& m);
Frame encode(const CreateRegion& m);
Frame encode_status_request();
Frame encode(const StatusReply& m);
Frame encode(const DebugRead& m);
Frame encode_debug_read_reply(std::span<const uint8_t> data);
Frame encode_goodbye();
Frame encode(const RegisterRegion& m);

// Payload decoders (the header was decoded and checked first). Each checks every field and
// rejects specs that do not validate.
Result<Hello> decode_hello(std::span<const uint8_t> p, uint32_t field_mask);
Result<Welcome> decode_welcome(std::span<const uint8_t> p, uint32_t field_mask);
Result<ErrorMsg> decode_error(std::span<const uint8_t> p, uint32_t field_mask);
Result<MapRegion> decode_map_region(std::span<const uint8_t> p, uint32_t field_mask);
Result<RegionHandle> decode_region_handle(std::span<const uint8_t> p, uint32_t field_mask);
Result<CreateRegion> decode_create_region(std::span<const uint8_t> p, uint32_t field_mask);
Result<StatusReply> decode_status_reply(std::span<const uint8_t> p, uint32_t field_mask);
Result<DebugRead> decode_debug_read(std::span<const uint8_t> p, uint32_t field_mask);
Result<RegisterRegion> decode_register_region(std::span<const uint8_t> p, uint32_t field_mask);

/// Splits a byte stream into frames: feed bytes, take complete frames. Used by tests and the
/// fuzzer; the daemon reads header and payload with exact sizes instead.
struct DecodedFrame {
  Header header;
  std::vector<uint8_t> payload;
};
/// Decodes one frame from the front of `bytes`: the frame and the bytes it used, 0 bytes used
/// when more input is needed, or an error.
Result<std::pair<DecodedFrame, size_t>> decode_frame(std::span<const uint8_t> bytes);
/// Decodes the payload of any message type, for validation (the fuzz target calls this).
Status validate_payload(const Header& h, std::span<const uint8_t> payload);

}  // namespace kvferry::proto

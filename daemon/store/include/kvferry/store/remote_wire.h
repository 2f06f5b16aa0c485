#pragma once
// The messages daemons exchange over the remote tier's control channel (UCX active messages).
// Every message starts with a fixed 24-byte header {magic, version, type, field_mask, length,
// request_id}, little-endian, then `length` bytes of body. Decoding never trusts a length: a
// Reader fails (kProtocol) rather than read past the end, and a count is checked against the bytes
// left before anything is allocated. Optional body fields grow by field_mask bits.
//
// Transport messages (kHello .. kRefused) carry the authenticated handshake; kRequest/kResponse
// carry an operation (RemoteOp) with a request id; the bodies of the operations (lookup, reserve,
// commit, notify) are defined here too so that both ends share one codec.
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/layouts/status.h"
#include "kvferry/store/block_key.h"

namespace kvferry::store::wire {

constexpr uint32_t kMagic = 0x5246564bu;  // "KVFR"
constexpr uint16_t kVersion = 1;
constexpr size_t kHeaderBytes = 24;
constexpr size_t kMaxBody = 1u << 20;  ///< control messages are small; anything larger is refused

enum class MsgType : uint16_t {
  kHello = 1,      ///< client → server: {nonce_c}
  kChallenge = 2,  ///< server → client: {nonce_s, mac_s}
  kAuth = 3,       ///< client → server: {mac_c, PeerHello}
  kWelcome = 4,    ///< server → client: {mac_w, PeerHello}
  kRefused = 5,    ///< either way: {reason}; the sender closes
  kRequest = 6,    ///< {op, body}; answered by kResponse with the same request_id
  kResponse = 7,   ///< {status code, message, body}
};

/// Operations carried by kRequest (the body layouts below).
enum class RemoteOp : uint16_t {
  kLookup = 1,       ///< LookupRequest → LookupReply
  kReserve = 2,      ///< ReserveRequest → ReserveReply: slots in the owner's pool to put blocks into
  kCommit = 3,       ///< CommitRequest → CommitReply: the put blocks are complete, check and index them
  kNotify = 4,       ///< Notify → empty: per-block outcome of a send (prefill → decode)
  kPing = 5,         ///< any bytes → the same bytes
  kLocalExport = 6,  ///< LocalExportRequest → LocalExportReply: import one of the owner's regions (same host)
  kLocalLanded = 7,  ///< LocalLanded → CommitReply: blocks were copied into that region, region to region
};

struct Header {
  uint32_t magic = kMagic;
  uint16_t version = kVersion;
  MsgType type = MsgType::kHello;
  uint32_t field_mask = 0;
  uint32_t length = 0;  ///< body bytes after the header
  uint64_t request_id = 0;
};

/// Appends little-endian fixed-width fields and length-prefixed strings.
class Writer {
 public:
  void u8(uint8_t v) { buf_.push_back(v); }
  void u16(uint16_t v) { put(&v, 2); }
  void u32(uint32_t v) { put(&v, 4); }
  void u64(uint64_t v) { put(&v, 8); }
  void key(const BlockKey& k) {
    u64(k.hi);
    u64(k.lo);
  }
  /// u32 length, then the bytes.
  void bytes(std::span<const uint8_t> b) {
    u32(uint32_t(b.size()));
    buf_.insert(buf_.end(), b.begin(), b.end());
  }
  void str(std::string_view s) { bytes({reinterpret_cast<const uint8_t*>(s.data()), s.size()}); }
  void raw(std::span<const uint8_t> b) { buf_.insert(buf_.end(), b.begin(), b.end()); }
  std::vector<uint8_t>& buffer() { return buf_; }

 private:
  void put(const void* p, size_t n) {  // the wire is little-endian, as are the hosts kvferry runs on
    const auto* b = static_cast<const uint8_t*>(p);
    buf_.insert(buf_.end(), b, b + n);
  }
  std::vector<uint8_t> buf_;
};

/// Reads what a Writer wrote; any read past the end sets the error and returns zeros.
class Reader {
 public:
  explicit Reader(std::span<const uint8_t> b) : b_(b) {}
  uint8_t u8() { return get<uint8_t>(); }
  uint16_t u16() { return get<uint16_t>(); }
  uint32_t u32() { return get<uint32_t>(); }
  uint64_t u64() { return get<uint64_t>(); }
  BlockKey key() {
    BlockKey k;
    k.hi = u64();
    k.lo = u64();
    return k;
  }
  std::span<const uint8_t> bytes(size_t max = kMaxBody) {
    uint32_t n = u32();
    if (!ok_ || n > max || n > left()) {
      ok_ = false;
      return {};
    }
    auto s = b_.subspan(pos_, n);
    pos_ += n;
    return s;
  }
  std::string str(size_t max = 4096) {
    auto s = bytes(max);
    return std::string(reinterpret_cast<const char*>(s.data()), s.size());
  }
  /// A count of items of at least `min_item_bytes` each: fails if they cannot fit in what is left.
  uint32_t count(size_t min_item_bytes) {
    uint32_t n = u32();
    if (ok_ && uint64_t(n) * min_item_bytes > left()) ok_ = false;
    return ok_ ? n : 0;
  }
  size_t left() const { return b_.size() - pos_; }
  bool ok() const { return ok_; }
  /// Ok when everything was read and nothing is left over.
  Status finish(const char* what) const {
    if (!ok_) return Status(ErrorCode::kProtocol, std::string(what) + ": truncated or oversized field");
    if (left() != 0) return Status(ErrorCode::kProtocol, std::string(what) + ": trailing bytes");
    return Status::Ok();
  }

 private:
  template <class T>
  T get() {
    T v{};
    if (!ok_ || left() < sizeof(T)) {
      ok_ = false;
      return v;
    }
    std::memcpy(&v, b_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::span<const uint8_t> b_;
  size_t pos_ = 0;
  bool ok_ = true;
};

/// Header + body in one buffer.
inline std::vector<uint8_t> frame(MsgType type, uint64_t request_id, std::span<const uint8_t> body,
                                  uint32_t field_mask = 0) {
  Writer w;
  w.u32(kMagic);
  w.u16(kVersion);
  w.u16(uint16_t(type));
  w.u32(field_mask);
  w.u32(uint32_t(body.size()));
  w.u64(request_id);
  w.raw(body);
  return std::move(w.buffer());
}

/// Splits a received message into header and body. kProtocol for a short buffer, a wrong magic, a
/// length that disagrees with the buffer or exceeds kMaxBody; kVersionMismatch for another version.
inline Status parse_frame(std::span<const uint8_t> msg, Header& h, std::span<const uint8_t>& body) {
  if (msg.size() < kHeaderBytes) return Status(ErrorCode::kProtocol, "message shorter than its header");
  Reader r(msg.first(kHeaderBytes));
  h.magic = r.u32();
  h.version = r.u16();
  h.type = MsgType(r.u16());
  h.field_mask = r.u32();
  h.length = r.u32();
  h.request_id = r.u64();
  if (h.magic != kMagic) return Status(ErrorCode::kProtocol, "bad magic");
  if (h.version != kVersion)
    return Status(ErrorCode::kVersionMismatch, "peer speaks version " + std::to_string(h.version));
  if (h.length > kMaxBody || h.length != msg.size() - kHeaderBytes)
    return Status(ErrorCode::kProtocol, "body length " + std::to_string(h.length) + " disagrees with the message");
  body = msg.subspan(kHeaderBytes);
  return Status::Ok();
}

/// What each side of a connection tells the other once authenticated (inside kAuth / kWelcome).
struct PeerHello {
  std::string name;          ///< member id
  uint64_t incarnation = 0;  ///< a restarted daemon has a new one
  uint64_t pool_base = 0;    ///< address of the registered pool in the sender's process
  uint64_t pool_bytes = 0;
  std::vector<uint8_t> rkey;  ///< packed remote key of the pool

  void encode(Writer& w) const {
    w.str(name);
    w.u64(incarnation);
    w.u64(pool_base);
    w.u64(pool_bytes);
    w.bytes(rkey);
  }
  static Result<PeerHello> decode(Reader& r) {
    PeerHello p;
    p.name = r.str(256);
    p.incarnation = r.u64();
    p.pool_base = r.u64();
    p.pool_bytes = r.u64();
    auto k = r.bytes(64 * 1024);
    p.rkey.assign(k.begin(), k.end());
    if (!r.ok()) return Status(ErrorCode::kProtocol, "peer hello: truncated");
    return p;
  }
};

// ---- operation bodies ----

/// Which blocks of namespace `ns` the owner holds.
struct LookupRequest {
  std::string ns;
  std::vector<BlockKey> keys;
  std::vector<uint8_t> encode() const {
    Writer w;
    w.str(ns);
    w.u32(uint32_t(keys.size()));
    for (auto& k : keys) w.key(k);
    return std::move(w.buffer());
  }
  static Result<LookupRequest> decode(std::span<const uint8_t> b) {
    Reader r(b);
    LookupRequest q;
    q.ns = r.str(255);
    uint32_t n = r.count(16);
    q.keys.reserve(n);
    for (uint32_t i = 0; i < n; ++i) q.keys.push_back(r.key());
    KVFERRY_TRY(r.finish("lookup request"));
    return q;
  }
};

/// Per key: where the owner holds it (pool offset, for a one-sided get), its size, checksum and format.
struct LookupEntry {
  bool found = false;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  uint64_t checksum = 0;
  std::string format;
  bool operator==(const LookupEntry&) const = default;
};

struct LookupReply {
  std::vector<LookupEntry> entries;
  std::vector<uint8_t> encode() const {
    Writer w;
    w.u32(uint32_t(entries.size()));
    for (auto& e : entries) {
      w.u8(e.found ? 1 : 0);
      w.u64(e.offset);
      w.u64(e.bytes);
      w.u64(e.checksum);
      w.str(e.format);
    }
    return std::move(w.buffer());
  }
  static Result<LookupReply> decode(std::span<const uint8_t> b) {
    Reader r(b);
    LookupReply q;
    uint32_t n = r.count(1 + 24 + 4);
    q.entries.resize(n);
    for (auto& e : q.entries) {
      e.found = r.u8() != 0;
      e.offset = r.u64();
      e.bytes = r.u64();
      e.checksum = r.u64();
      e.format = r.str(63);
    }
    KVFERRY_TRY(r.finish("lookup reply"));
    return q;
  }
};

/// Asks the owner for pool slots to put blocks into (one-sided), one per key, all of one format
/// and size; each is held until its commit or a timeout.
struct ReserveRequest {
  std::string ns;
  std::string format;  ///< the record format (TieredStore::record_format: "bf16@32x16")
  uint64_t bytes = 0;  ///< of each block
  std::vector<BlockKey> keys;
  /// Sent by a peer's send (prefill → decode) rather than by placement: the owner tells its
  /// waiting clients when the blocks land.
  bool send = false;
  /// A send into one of the owner's regions: after the commit the owner loads each block into
  /// block `land_ids[i]` of region `land_region` (0 = none); one id per key.
  uint32_t land_region = 0;
  std::vector<int64_t> land_ids;
  std::vector<uint8_t> encode() const {
    Writer w;
    w.str(ns);
    w.str(format);
    w.u64(bytes);
    w.u8(send ? 1 : 0);
    w.u32(land_region);
    w.u32(uint32_t(keys.size()));
    for (auto& k : keys) w.key(k);
    if (land_region != 0)
      for (size_t i = 0; i < keys.size(); ++i) w.u64(uint64_t(i < land_ids.size() ? land_ids[i] : -1));
    return std::move(w.buffer());
  }
  static Result<ReserveRequest> decode(std::span<const uint8_t> b) {
    Reader r(b);
    ReserveRequest q;
    q.ns = r.str(255);
    q.format = r.str(63);
    q.bytes = r.u64();
    q.send = r.u8() != 0;
    q.land_region = r.u32();
    uint32_t n = r.count(q.land_region ? 24 : 16);
    q.keys.reserve(n);
    for (uint32_t i = 0; i < n; ++i) q.keys.push_back(r.key());
    if (q.land_region != 0)
      for (uint32_t i = 0; i < n; ++i) q.land_ids.push_back(int64_t(r.u64()));
    KVFERRY_TRY(r.finish("reserve request"));
    return q;
  }
};

/// Per key of a ReserveRequest: kOk with the slot's pool offset and a reservation to commit;
/// kAlreadyExists (the owner holds the key: nothing to put; with a land_region the reservation is
/// set, and committing it lands the held block); another code: refused.
struct ReserveEntry {
  ErrorCode code = ErrorCode::kOk;
  uint64_t offset = 0;       ///< into the owner's pool
  uint64_t reservation = 0;  ///< handed back in the commit
  bool operator==(const ReserveEntry&) const = default;
};

struct ReserveReply {
  std::vector<ReserveEntry> entries;
  std::vector<uint8_t> encode() const {
    Writer w;
    w.u32(uint32_t(entries.size()));
    for (auto& e : entries) {
      w.u16(uint16_t(e.code));
      w.u64(e.offset);
      w.u64(e.reservation);
    }
    return std::move(w.buffer());
  }
  static Result<ReserveReply> decode(std::span<const uint8_t> b) {
    Reader r(b);
    ReserveReply q;
    uint32_t n = r.count(18);
    q.entries.resize(n);
    for (auto& e : q.entries) {
      e.code = ErrorCode(int16_t(r.u16()));
      e.offset = r.u64();
      e.reservation = r.u64();
    }
    KVFERRY_TRY(r.finish("reserve reply"));
    return q;
  }
};

/// The blocks put into reserved slots are complete (`done`) or are to be dropped (not done: their
/// put failed): the owner checks each done one's checksum and indexes it. Answered by a
/// CommitReply with one code per item.
struct CommitItem {
  uint64_t reservation = 0;
  uint64_t checksum = 0;
  bool done = true;
  bool operator==(const CommitItem&) const = default;
};

struct CommitRequest {
  std::vector<CommitItem> items;
  std::vector<uint8_t> encode() const {
    Writer w;
    w.u32(uint32_t(items.size()));
    for (auto& i : items) {
      w.u64(i.reservation);
      w.u64(i.checksum);
      w.u8(i.done ? 1 : 0);
    }
    return std::move(w.buffer());
  }
  static Result<CommitRequest> decode(std::span<const uint8_t> b) {
    Reader r(b);
    CommitRequest q;
    uint32_t n = r.count(17);
    q.items.resize(n);
    for (auto& i : q.items) {
      i.reservation = r.u64();
      i.checksum = r.u64();
      i.done = r.u8() != 0;
    }
    KVFERRY_TRY(r.finish("commit request"));
    return q;
  }
};

struct CommitReply {
  std::vector<ErrorCode> codes;
  std::vector<uint8_t> encode() const {
    Writer w;
    w.u32(uint32_t(codes.size()));
    for (auto c : codes) w.u16(uint16_t(c));
    return std::move(w.buffer());
  }
  static Result<CommitReply> decode(std::span<const uint8_t> b) {
    Reader r(b);
    CommitReply q;
    uint32_t n = r.count(2);
    for (uint32_t i = 0; i < n; ++i) q.codes.push_back(ErrorCode(int16_t(r.u16())));
    KVFERRY_TRY(r.finish("commit reply"));
    return q;
  }
};

/// Per-block outcome of a send, to the side that did not drive it.
struct Notify {
  std::string ns;
  std::vector<BlockKey> keys;
  std::vector<ErrorCode> codes;  ///< one per key
  std::vector<uint8_t> encode() const {
    Writer w;
    w.str(ns);
    w.u32(uint32_t(keys.size()));
    for (size_t i = 0; i < keys.size(); ++i) {
      w.key(keys[i]);
      w.u16(uint16_t(i < codes.size() ? codes[i] : ErrorCode::kInternal));
    }
    return std::move(w.buffer());
  }
  static Result<Notify> decode(std::span<const uint8_t> b) {
    Reader r(b);
    Notify q;
    q.ns = r.str(255);
    uint32_t n = r.count(18);
    for (uint32_t i = 0; i < n; ++i) {
      q.keys.push_back(r.key());
      q.codes.push_back(ErrorCode(int16_t(r.u16())));
    }
    KVFERRY_TRY(r.finish("notify"));
    return q;
  }
};

/// A sender on the same host asks to import region `region` of the namespace's tenant, for sends
/// that copy region to region.
struct LocalExportRequest {
  std::string ns;  ///< namespace name (its tenant must reach the region)
  uint32_t region = 0;
  std::vector<uint8_t> encode() const {
    Writer w;
    w.str(ns);
    w.u32(region);
    return std::move(w.buffer());
  }
  static Result<LocalExportRequest> decode(std::span<const uint8_t> b) {
    Reader r(b);
    LocalExportRequest q;
    q.ns = r.str(255);
    q.region = r.u32();
    KVFERRY_TRY(r.finish("local export request"));
    return q;
  }
};

/// How to import it: the host it runs on (boot id: a sender elsewhere cannot import), its
/// control socket and a one-time token for the Hello (proto::Hello::peer_token).
struct LocalExportReply {
  std::string boot_id;
  std::string socket;
  std::string token;
  std::vector<uint8_t> encode() const {
    Writer w;
    w.str(boot_id);
    w.str(socket);
    w.str(token);
    return std::move(w.buffer());
  }
  static Result<LocalExportReply> decode(std::span<const uint8_t> b) {
    Reader r(b);
    LocalExportReply q;
    q.boot_id = r.str(64);
    q.socket = r.str(4096);
    q.token = r.str(64);
    KVFERRY_TRY(r.finish("local export reply"));
    return q;
  }
};

/// Blocks `keys` of namespace `ns` were copied into blocks `ids` of region `region` (answered by
/// a CommitReply: one code per block).
struct LocalLanded {
  std::string ns;
  std::string token;  ///< the import's (LocalExportReply::token): names what the sender copied into
  uint32_t region = 0;
  std::vector<BlockKey> keys;
  std::vector<int64_t> ids;  ///< one per key
  std::vector<uint8_t> encode() const {
    Writer w;
    w.str(ns);
    w.str(token);
    w.u32(region);
    w.u32(uint32_t(keys.size()));
    for (size_t i = 0; i < keys.size(); ++i) {
      w.key(keys[i]);
      w.u64(uint64_t(i < ids.size() ? ids[i] : -1));
    }
    return std::move(w.buffer());
  }
  static Result<LocalLanded> decode(std::span<const uint8_t> b) {
    Reader r(b);
    LocalLanded q;
    q.ns = r.str(255);
    q.token = r.str(64);
    q.region = r.u32();
    uint32_t n = r.count(24);
    q.keys.reserve(n);
    q.ids.reserve(n);
    for (uint32_t i = 0; i < n; ++i) {
      q.keys.push_back(r.key());
      q.ids.push_back(int64_t(r.u64()));
    }
    KVFERRY_TRY(r.finish("local landed"));
    return q;
  }
};

}  // namespace kvferry::store::wire

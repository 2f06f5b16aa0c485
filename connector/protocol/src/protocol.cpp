// Wire encoding and bounds-checked decoding of the control messages (protocol.h).
#include "kvferry/connector/protocol.h"

#include <cstring>

namespace kvferry::proto {

std::string_view backend_name(Backend b) {
  switch (b) {
    case Backend::kMemfd: return "memfd";
    case Backend::kCudaVmm: return "cuda_vmm";
    case Backend::kCudaIpc: return "cuda_ipc";
  }
  return "unknown";
}

namespace {
void put_le(uint8_t* p, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint64_t get_le(const uint8_t* p, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}
}  // namespace

void encode_header(const Header& h, uint8_t out[kHeaderBytes]) {
  put_le(out, h.magic, 4);
  put_le(out + 4, h.version, 2);
  put_le(out + 6, h.type, 2);
  put_le(out + 8, h.length, 4);
  put_le(out + 12, h.field_mask, 4);
}

Result<Header> decode_header(std::span<const uint8_t> b) {
  if (b.size() < kHeaderBytes)
    return Result<Header>(ErrorCode::kProtocol, "truncated header: " + std::to_string(b.size()) + " of " +
                                                    std::to_string(kHeaderBytes) + " bytes");
  Header h;
  h.magic = static_cast<uint32_t>(get_le(b.data(), 4));
  h.version = static_cast<uint16_t>(get_le(b.data() + 4, 2));
  h.type = static_cast<uint16_t>(get_le(b.data() + 6, 2));
  h.length = static_cast<uint32_t>(get_le(b.data() + 8, 4));
  h.field_mask = static_cast<uint32_t>(get_le(b.data() + 12, 4));
  char hex[16];
  if (h.magic != kMagic) {
    std::snprintf(hex, sizeof hex, "0x%08x", h.magic);
    return Result<Header>(ErrorCode::kProtocol, std::string("bad magic ") + hex + " (expected 0x5946564b 'KVFY')");
  }
  if (h.version != kVersion)
    return Result<Header>(ErrorCode::kVersionMismatch, "protocol version " + std::to_string(h.version) +
                                                           " is not supported (this side speaks " +
                                                           std::to_string(kVersion) + ")");
  if (h.type == 0 || h.type > kMaxMsgType)
    return Result<Header>(ErrorCode::kProtocol, "unknown message type " + std::to_string(h.type));
  if (h.length > kMaxPayload)
    return Result<Header>(ErrorCode::kProtocol, "payload length " + std::to_string(h.length) +
                                                    " exceeds the limit of " + std::to_string(kMaxPayload) + " bytes");
  return h;
}

void Writer::u16(uint16_t v) {
  uint8_t b[2];
  put_le(b, v, 2);
  buf_.insert(buf_.end(), b, b + 2);
}
void Writer::u32(uint32_t v) {
  uint8_t b[4];
  put_le(b, v, 4);
  buf_.insert(buf_.end(), b, b + 4);
}
void Writer::u64(uint64_t v) {
  uint8_t b[8];
  put_le(b, v, 8);
  buf_.insert(buf_.end(), b, b + 8);
}
void Writer::str(std::string_view s) {
  u32(static_cast<uint32_t>(s.size()));
  buf_.insert(buf_.end(), s.begin(), s.end());
}

bool Reader::need(size_t n, const char* field) {
  if (!status_.ok()) return false;
  if (n > b_.size() - pos_) {
    status_ =
        Status(ErrorCode::kProtocol, std::string("truncated payload: field '") + field + "' needs " +
                                         std::to_string(n) + " bytes, " + std::to_string(b_.size() - pos_) + " left");
    return false;
  }
  return true;
}
uint8_t Reader::u8(const char* f) {
  if (!need(1, f)) return 0;
  return b_[pos_++];
}
uint16_t Reader::u16(const char* f) {
  if (!need(2, f)) return 0;
  auto v = static_cast<uint16_t>(get_le(b_.data() + pos_, 2));
  pos_ += 2;
  return v;
}
uint32_t Reader::u32(const char* f) {
  if (!need(4, f)) return 0;
  auto v = static_cast<uint32_t>(get_le(b_.data() + pos_, 4));
  pos_ += 4;
  return v;
}
uint64_t Reader::u64(const char* f) {
  if (!need(8, f)) return 0;
  uint64_t v = get_le(b_.data() + pos_, 8);
  pos_ += 8;
  return v;
}
std::string Reader::str(const char* f, uint32_t max_len) {
  uint32_t n = u32(f);
  if (!ok()) return {};
  if (n > max_len) {
    fail(Status(ErrorCode::kProtocol, std::string("field '") + f + "' is " + std::to_string(n) +
                                          " bytes long, the limit is " + std::to_string(max_len)));
    return {};
  }
  if (!need(n, f)) return {};
  std::string s(reinterpret_cast<const char*>(b_.data() + pos_), n);
  pos_ += n;
  return s;
}
std::span<const uint8_t> Reader::bytes(const char* f, size_t n) {
  if (!need(n, f)) return {};
  auto s = b_.subspan(pos_, n);
  pos_ += n;
  return s;
}

namespace {

Frame finish(MsgType t, Writer& w, uint32_t field_mask = 0) {
  Frame f(kHeaderBytes);
  Header h;
  h.type = static_cast<uint16_t>(t);
  h.length = static_cast<uint32_t>(w.buffer().size());
  h.field_mask = field_mask;
  encode_header(h, f.data());
  f.insert(f.end(), w.buffer().begin(), w.buffer().end());
  return f;
}

void put_spec(Writer& w, const KvCacheSpec& s) {
  w.i64(s.layers);
  w.i64(s.blocks);
  w.i64(s.block_size);
  w.str(s.format.name());
  w.u8(static_cast<uint8_t>(s.layout));
}

KvCacheSpec get_spec(Reader& r) {
  KvCacheSpec s;
  s.layers = r.i64("spec.layers");
  s.blocks = r.i64("spec.blocks");
  s.block_size = r.i64("spec.block_size");
  std::string fmt = r.str("spec.format", 64);
  uint8_t layout = r.u8("spec.layout");
  if (!r.ok()) return s;
  auto f = EntryFormat::parse(fmt);
  if (!f.ok()) {
    r.fail(Status(ErrorCode::kProtocol, "spec.format: " + f.status().message()));
    return s;
  }
  s.format = *f;
  if (layout > 1) {
    r.fail(Status(ErrorCode::kProtocol, "spec.layout " + std::to_string(layout) + " is not 0 or 1"));
    return s;
  }
  s.layout = static_cast<Layout>(layout);
  if (Status st = s.validate(); !st.ok()) r.fail(Status(ErrorCode::kProtocol, "spec: " + st.message()));
  return s;
}

void put_region(Writer& w, const RegionDesc& d) {
  w.u32(d.id);
  w.str(d.name);
  put_spec(w, d.spec);
  w.u64(d.bytes);
  w.u64(d.alloc_bytes);
  w.u8(static_cast<uint8_t>(d.backend));
  w.i32(d.device);
}

RegionDesc get_region(Reader& r) {
  RegionDesc d;
  d.id = r.u32("region.id");
  d.name = r.str("region.name", 256);
  d.spec = get_spec(r);
  d.bytes = r.u64("region.bytes");
  d.alloc_bytes = r.u64("region.alloc_bytes");
  uint8_t b = r.u8("region.backend");
  d.device = r.i32("region.device");
  if (!r.ok()) return d;
  if (b > 2) r.fail(Status(ErrorCode::kProtocol, "region.backend " + std::to_string(b) + " is unknown"));
  d.backend = static_cast<Backend>(b);
  if (d.bytes != static_cast<uint64_t>(d.spec.region_bytes()) || d.alloc_bytes < d.bytes)
    r.fail(Status(ErrorCode::kProtocol, "region '" + d.name + "': bytes " + std::to_string(d.bytes) +
                                            " / alloc_bytes " + std::to_string(d.alloc_bytes) +
                                            " do not match its spec (" + std::to_string(d.spec.region_bytes()) + ")"));
  return d;
}

/// Bounded count of list entries: each entry needs at least `min_entry` bytes, so a count that
/// the remaining payload cannot hold is rejected before anything is reserved.
uint32_t get_count(Reader& r, const char* field, size_t min_entry) {
  uint32_t n = r.u32(field);
  if (r.ok() && static_cast<uint64_t>(n) * min_entry > r.remaining())
    r.fail(Status(ErrorCode::kProtocol, std::string("field '") + field + "' claims " + std::to_string(n) +
                                            " entries, the payload holds at most " +
                                            std::to_string(r.remaining() / min_entry)));
  return r.ok() ? n : 0;
}

template <class T>
Result<T> done(Reader& r, T v) {
  if (!r.ok()) return r.status();
  return v;
}

}  // namespace

Frame encode(const Hello& m) {
  Writer w;
  w.str(m.client_name);
  w.u32(m.pid);
  if (m.has_namespace) {
    w.str(m.model);
    w.str(m.tenant);
  }
  if (!m.peer_token.empty()) w.str(m.peer_token);
  return finish(MsgType::kHello, w,
                (m.has_namespace ? kFieldNamespace : 0) | (m.peer_token.empty() ? 0 : kFieldPeerToken));
}
Result<Hello> decode_hello(std::span<const uint8_t> p, uint32_t fm) {
  Reader r(p);
  Hello m;
  m.client_name = r.str("client_name", 256);
  m.pid = r.u32("pid");
  if (fm & kFieldNamespace) {
    m.has_namespace = true;
    m.model = r.str("model", 256);
    m.tenant = r.str("tenant", 256);
  }
  if (fm & kFieldPeerToken) m.peer_token = r.str("peer_token", kMaxPeerToken);
  return done(r, std::move(m));
}

Frame encode(const Welcome& m) {
  Writer w;
  w.u32(m.client_id);
  w.u32(m.ring_entries);
  w.u64(m.ring_bytes);
  w.u32(m.arena_bytes);
  w.u32(m.spin_us);
  w.u32(static_cast<uint32_t>(m.regions.size()));
  for (const auto& d : m.regions) put_region(w, d);
  return finish(MsgType::kWelcome, w);
}
Result<Welcome> decode_welcome(std::span<const uint8_t> p, uint32_t) {
  Reader r(p);
  Welcome m;
  m.client_id = r.u32("client_id");
  m.ring_entries = r.u32("ring_entries");
  m.ring_bytes = r.u64("ring_bytes");
  m.arena_bytes = r.u32("arena_bytes");
  m.spin_us = r.u32("spin_us");
  uint32_t n = get_count(r, "regions", 40);
  for (uint32_t i = 0; i < n && r.ok(); ++i) m.regions.push_back(get_region(r));
  if (r.ok() && (m.ring_entries == 0 || (m.ring_entries & (m.ring_entries - 1)) != 0))
    r.fail(Status(ErrorCode::kProtocol, "ring_entries " + std::to_string(m.ring_entries) + " is not a power of two"));
  return done(r, std::move(m));
}

Frame encode(const ErrorMsg& m) {
  Writer w;
  w.u16(static_cast<uint16_t>(m.code));
  w.str(m.message);
  return finish(MsgType::kError, w);
}
Result<ErrorMsg> decode_error(std::span<const uint8_t> p, uint32_t) {
  Reader r(p);
  ErrorMsg m;
  m.code = static_cast<ErrorCode>(static_cast<int16_t>(r.u16("code")));
  m.message = r.str("message", 65536);
  return done(r, std::move(m));
}

Frame encode(const MapRegion& m) {
  Writer w;
  w.u32(m.region_id);
  return finish(MsgType::kMapRegion, w);
}
Result<MapRegion> decode_map_region(std::span<const uint8_t> p, uint32_t) {
  Reader r(p);
  MapRegion m;
  m.region_id = r.u32("region_id");
  return done(r, m);
}

Frame encode(const RegionHandle& m) {
  Writer w;
  put_region(w, m.region);
  if (m.has_ipc_handle) w.bytes(std::span<const uint8_t>(m.ipc_handle, 64));
  if (m.offset) w.u64(m.offset);
  return finish(MsgType::kRegionHandle, w, (m.has_ipc_handle ? kFieldIpcHandle : 0) | (m.offset ? kFieldOffset : 0));
}
Result<RegionHandle> decode_region_handle(std::span<const uint8_t> p, uint32_t field_mask) {
  Reader r(p);
  RegionHandle m;
  m.region = get_region(r);
  if (field_mask & kFieldIpcHandle) {
    auto b = r.bytes("ipc_handle", 64);
    if (r.ok()) {
      std::memcpy(m.ipc_handle, b.data(), 64);
      m.has_ipc_handle = true;
    }
  }
  if (field_mask & kFieldOffset) m.offset = r.u64("offset");
  return done(r, std::move(m));
}

Frame encode(const CreateRegion& m) {
  Writer w;
  w.str(m.name);
  put_spec(w, m.spec);
  return finish(MsgType::kCreateRegion, w);
}
Result<CreateRegion> decode_create_region(std::span<const uint8_t> p, uint32_t) {
  Reader r(p);
  CreateRegion m;
  m.name = r.str("name", 256);
  m.spec = get_spec(r);
  if (r.ok() && m.name.empty()) r.fail(Status(ErrorCode::kProtocol, "region name is empty"));
  return done(r, std::move(m));
}

Frame encode_status_request() {
  Writer w;
  return finish(MsgType::kStatusRequest, w);
}

Frame encode(const StatusReply& m) {
  Writer w;
  w.str(m.version);
  w.u64(m.uptime_ms);
  w.u32(m.pid);
  w.str(m.backend);
  w.u32(static_cast<uint32_t>(m.regions.size()));
  for (const auto& x : m.regions) {
    put_region(w, x.desc);
    w.u32(x.holders);
    w.u8(x.from_config ? 1 : 0);
  }
  w.u32(static_cast<uint32_t>(m.clients.size()));
  for (const auto& c : m.clients) {
    w.u32(c.id);
    w.str(c.name);
    w.u32(c.pid);
    w.u32(c.uid);
    w.u64(c.ops);
  }
  return finish(MsgType::kStatusReply, w);
}
Result<StatusReply> decode_status_reply(std::span<const uint8_t> p, uint32_t) {
  Reader r(p);
  StatusReply m;
  m.version = r.str("version", 256);
  m.uptime_ms = r.u64("uptime_ms");
  m.pid = r.u32("pid");
  m.backend = r.str("backend", 64);
  uint32_t n = get_count(r, "regions", 45);
  for (uint32_t i = 0; i < n && r.ok(); ++i) {
    StatusReply::Region x;
    x.desc = get_region(r);
    x.holders = r.u32("holders");
    x.from_config = r.u8("from_config") != 0;
    m.regions.push_back(std::move(x));
  }
  uint32_t c = get_count(r, "clients", 24);
  for (uint32_t i = 0; i < c && r.ok(); ++i) {
    StatusReply::Client x;
    x.id = r.u32("client.id");
    x.name = r.str("client.name", 256);
    x.pid = r.u32("client.pid");
    x.uid = r.u32("client.uid");
    x.ops = r.u64("client.ops");
    m.clients.push_back(std::move(x));
  }
  return done(r, std::move(m));
}

Frame encode(const DebugRead& m) {
  Writer w;
  w.u32(m.region_id);
  w.u64(m.offset);
  w.u32(m.bytes);
  return finish(MsgType::kDebugRead, w);
}
Result<DebugRead> decode_debug_read(std::span<const uint8_t> p, uint32_t) {
  Reader r(p);
  DebugRead m;
  m.region_id = r.u32("region_id");
  m.offset = r.u64("offset");
  m.bytes = r.u32("bytes");
  if (r.ok() && m.bytes > kMaxDebugRead)
    r.fail(Status(ErrorCode::kProtocol, "debug read of " + std::to_string(m.bytes) + " bytes exceeds the limit of " +
                                            std::to_string(kMaxDebugRead)));
  return done(r, m);
}

Frame encode_debug_read_reply(std::span<const uint8_t> data) {
  Writer w;
  w.bytes(data);
  return finish(MsgType::kDebugReadReply, w);
}

Frame encode_goodbye() {
  Writer w;
  return finish(MsgType::kGoodbye, w);
}

Frame encode(const RegisterRegion& m) {
  Writer w;
  w.str(m.name);
  put_spec(w, m.spec);
  w.u8(static_cast<uint8_t>(m.backend));
  w.i32(m.device);
  w.u64(m.alloc_bytes);
  if (m.has_ipc_handle) w.bytes(std::span<const uint8_t>(m.ipc_handle, 64));
  if (m.offset) w.u64(m.offset);
  return finish(MsgType::kRegisterRegion, w, (m.has_ipc_handle ? kFieldIpcHandle : 0) | (m.offset ? kFieldOffset : 0));
}
Result<RegisterRegion> decode_register_region(std::span<const uint8_t> p, uint32_t field_mask) {
  Reader r(p);
  RegisterRegion m;
  m.name = r.str("name", 256);
  m.spec = get_spec(r);
  const uint8_t b = r.u8("backend");
  m.device = r.i32("device");
  m.alloc_bytes = r.u64("alloc_bytes");
  if (field_mask & kFieldIpcHandle) {
    auto h = r.bytes("ipc_handle", 64);
    if (r.ok()) {
      std::memcpy(m.ipc_handle, h.data(), 64);
      m.has_ipc_handle = true;
    }
  }
  if (field_mask & kFieldOffset) m.offset = r.u64("offset");
  if (!r.ok()) return r.status();
  if (m.name.empty()) return Result<RegisterRegion>(ErrorCode::kProtocol, "region name is empty");
  if (b > 2) return Result<RegisterRegion>(ErrorCode::kProtocol, "backend " + std::to_string(b) + " is unknown");
  m.backend = static_cast<Backend>(b);
  if (m.alloc_bytes < static_cast<uint64_t>(m.spec.region_bytes()) ||
      m.offset > m.alloc_bytes - static_cast<uint64_t>(m.spec.region_bytes()))
    return Result<RegisterRegion>(ErrorCode::kProtocol, "alloc_bytes " + std::to_string(m.alloc_bytes) +
                                                            " cannot hold the spec's " +
                                                            std::to_string(m.spec.region_bytes()) +
                                                            " bytes at offset " + std::to_string(m.offset));
  if (m.offset % static_cast<uint64_t>(m.spec.format.alignment()) != 0)
    return Result<RegisterRegion>(ErrorCode::kProtocol, "offset " + std::to_string(m.offset) +
                                                            " is not a multiple of the format's alignment (" +
                                                            std::to_string(m.spec.format.alignment()) + " bytes)");
  if ((m.backend == Backend::kCudaIpc) != m.has_ipc_handle)
    return Result<RegisterRegion>(ErrorCode::kProtocol, "an IPC handle comes with, and only with, backend cuda_ipc");
  return m;
}

Result<std::pair<DecodedFrame, size_t>> decode_frame(std::span<const uint8_t> bytes) {
  using R = Result<std::pair<DecodedFrame, size_t>>;
  if (bytes.size() < kHeaderBytes) return std::pair<DecodedFrame, size_t>{DecodedFrame{}, 0};
  auto h = decode_header(bytes.first(kHeaderBytes));
  if (!h.ok()) return R(h.status());
  if (bytes.size() - kHeaderBytes < h->length) return std::pair<DecodedFrame, size_t>{DecodedFrame{}, 0};
  DecodedFrame f;
  f.header = *h;
  f.payload.assign(bytes.begin() + kHeaderBytes, bytes.begin() + kHeaderBytes + h->length);
  return std::pair<DecodedFrame, size_t>{std::move(f), kHeaderBytes + h->length};
}

Status validate_payload(const Header& h, std::span<const uint8_t> p) {
  const uint32_t fm = h.field_mask;
  switch (static_cast<MsgType>(h.type)) {
    case MsgType::kHello: return decode_hello(p, fm).status();
    case MsgType::kWelcome: return decode_welcome(p, fm).status();
    case MsgType::kError: return decode_error(p, fm).status();
    case MsgType::kMapRegion: return decode_map_region(p, fm).status();
    case MsgType::kRegionHandle: return decode_region_handle(p, fm).status();
    case MsgType::kCreateRegion: return decode_create_region(p, fm).status();
    case MsgType::kStatusRequest: return Status::Ok();
    case MsgType::kStatusReply: return decode_status_reply(p, fm).status();
    case MsgType::kDebugRead: return decode_debug_read(p, fm).status();
    case MsgType::kDebugReadReply: return Status::Ok();
    case MsgType::kGoodbye: return Status::Ok();
    case MsgType::kRegisterRegion: return decode_register_region(p, fm).status();
  }
  return {ErrorCode::kProtocol, "unknown message type " + std::to_string(h.type)};
}

}  // namespace kvferry::proto

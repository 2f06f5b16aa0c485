// The C ABI (kvferry.h) over kvferry::Client. Every entry point catches everything: no
// exception crosses into C.
#include "kvferry/connector/kvferry.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <string>

#include "kvferry/connector/client.h"

struct kvferry_client {
  std::unique_ptr<kvferry::Client> c;
};

namespace {

using kvferry::ErrorCode;
using kvferry::Status;

thread_local std::string g_last_error;

static_assert(sizeof(kvferry_sqe) == sizeof(kvferry::ring::SubmitEntry));
static_assert(sizeof(kvferry_cqe) == sizeof(kvferry::ring::CompletionEntry));
static_assert(offsetof(kvferry_cqe, result) == offsetof(kvferry::ring::CompletionEntry, result));
static_assert(sizeof(kvferry_key) == sizeof(kvferry::ops::Key));
static_assert(sizeof(kvferry_stats_info) == sizeof(kvferry::ops::StatsWire));
static_assert(sizeof(kvferry_ls_entry) == sizeof(kvferry::ops::LsEntry));
static_assert(offsetof(kvferry_ls_entry, tier) == offsetof(kvferry::ops::LsEntry, tier));
static_assert(offsetof(kvferry_sqe, args) == offsetof(kvferry::ring::SubmitEntry, args));
static_assert(sizeof(kvferry_store_stats) == sizeof(uint64_t) + sizeof(kvferry::ops::StatsWire));
static_assert(sizeof(kvferry_tier_stats) == 280);
static_assert(sizeof(kvferry_tier_stats::tier) == sizeof(kvferry::ops::TierStatsWire::tier) &&
              sizeof(kvferry_tier_stats::reason) == sizeof(kvferry::ops::TierStatsWire::reason) &&
              sizeof(kvferry_tier_stats::member) == sizeof(kvferry::ops::TierStatsWire::member));

// The C enum is ErrorCode, value for value; the ABI-1 macros keep theirs.
constexpr bool same(kvferry_error a, ErrorCode b) { return static_cast<int>(a) == static_cast<int>(b); }
static_assert(
    same(KVFERRY_ERROR_OK, ErrorCode::kOk) && same(KVFERRY_ERROR_INVALID_ARGUMENT, ErrorCode::kInvalidArgument) &&
    same(KVFERRY_ERROR_OUT_OF_RANGE, ErrorCode::kOutOfRange) && same(KVFERRY_ERROR_OVERFLOW, ErrorCode::kOverflow) &&
    same(KVFERRY_ERROR_MISALIGNED, ErrorCode::kMisaligned) && same(KVFERRY_ERROR_NOT_FOUND, ErrorCode::kNotFound) &&
    same(KVFERRY_ERROR_ALREADY_EXISTS, ErrorCode::kAlreadyExists) &&
    same(KVFERRY_ERROR_RESOURCE_EXHAUSTED, ErrorCode::kResourceExhausted) &&
    same(KVFERRY_ERROR_UNAVAILABLE, ErrorCode::kUnavailable) && same(KVFERRY_ERROR_INTERNAL, ErrorCode::kInternal) &&
    same(KVFERRY_ERROR_UNSUPPORTED, ErrorCode::kUnsupported) && same(KVFERRY_ERROR_PROTOCOL, ErrorCode::kProtocol) &&
    same(KVFERRY_ERROR_VERSION_MISMATCH, ErrorCode::kVersionMismatch) &&
    same(KVFERRY_ERROR_PERMISSION_DENIED, ErrorCode::kPermissionDenied) &&
    same(KVFERRY_ERROR_CHECKSUM_MISMATCH, ErrorCode::kChecksumMismatch) &&
    same(KVFERRY_ERROR_TIMEOUT, ErrorCode::kTimeout) && same(KVFERRY_ERROR_CANCELLED, ErrorCode::kCancelled) &&
    same(KVFERRY_ERROR_IO, ErrorCode::kIo) && same(KVFERRY_ERROR_CUDA, ErrorCode::kCuda) &&
    same(KVFERRY_ERROR_UCX, ErrorCode::kUcx) && same(KVFERRY_ERROR_CONFIG, ErrorCode::kConfig) &&
    same(KVFERRY_ERROR_BUSY, ErrorCode::kBusy) && same(KVFERRY_ERROR_DATA_LOSS, ErrorCode::kDataLoss));
static_assert(KVFERRY_ERROR_COUNT == static_cast<int>(ErrorCode::kDataLoss) + 1,
              "a new ErrorCode needs its KVFERRY_ERROR_ value and KVFERRY_ERROR_COUNT moved");
static_assert(KVFERRY_OK == KVFERRY_ERROR_OK && KVFERRY_E_BUSY == KVFERRY_ERROR_BUSY &&
              KVFERRY_E_TIMEOUT == KVFERRY_ERROR_TIMEOUT && KVFERRY_E_NOT_FOUND == KVFERRY_ERROR_NOT_FOUND &&
              KVFERRY_E_EXHAUSTED == KVFERRY_ERROR_RESOURCE_EXHAUSTED &&
              KVFERRY_E_UNSUPPORTED == KVFERRY_ERROR_UNSUPPORTED &&
              KVFERRY_E_CHECKSUM_MISMATCH == KVFERRY_ERROR_CHECKSUM_MISMATCH);

#ifndef KVFERRY_VERSION_STRING
#define KVFERRY_VERSION_STRING "unknown"
#endif
#define KVFERRY_STR2_(x) #x
#define KVFERRY_STR_(x) KVFERRY_STR2_(x)
static_assert(kvferry::proto::kVersion == 1, "kVersionText names the protocol version");
constexpr const char* kVersionText = KVFERRY_VERSION_STRING " (abi " KVFERRY_STR_(KVFERRY_ABI_VERSION) ", protocol 1)";

int fail(const Status& st) {
  g_last_error = st.to_string();
  return static_cast<int>(st.code());
}
int ok() {
  g_last_error.clear();
  return 0;
}

template <class F>
int guard(F&& f) {
  try {
    return f();
  } catch (const std::exception& e) {
    return fail(Status(ErrorCode::kInternal, std::string("unexpected exception: ") + e.what()));
  } catch (...) {
    return fail(Status(ErrorCode::kInternal, "unexpected exception"));
  }
}

#define KVFERRY_C_CHECK(cond, what) \
  if (!(cond)) return fail(Status(ErrorCode::kInvalidArgument, what))

void to_c(const kvferry::LayerView& v, kvferry_view* out) {
  std::memset(out, 0, sizeof *out);
  out->data = v.data;
  out->dtype = static_cast<int32_t>(v.view.dtype);
  out->elem_bytes = static_cast<int32_t>(v.view.elem_bytes());
  out->rank = v.view.rank;
  out->on_device = v.on_device ? 1 : 0;
  for (int i = 0; i < v.view.rank && i < 4; ++i) {
    out->sizes[i] = v.view.sizes[i];
    out->strides[i] = v.view.strides[i];
  }
  out->offset = v.view.offset;
}

std::span<const kvferry::ops::Key> key_span(const kvferry_key* keys, uint32_t n) {
  return {reinterpret_cast<const kvferry::ops::Key*>(keys), n};
}

/// Copies a data op's outcome out; returns its overall code.
int op_out(const kvferry::Result<kvferry::Client::OpResult>& r, int16_t* statuses, uint32_t max_statuses,
           uint32_t* done, uint64_t* result) {
  if (!r.ok()) return fail(r.status());
  if (statuses)
    for (size_t i = 0; i < r->blocks.size() && i < max_statuses; ++i) statuses[i] = static_cast<int16_t>(r->blocks[i]);
  if (done) *done = r->done;
  if (result) std::memcpy(result, r->result, sizeof r->result);
  if (r->status == ErrorCode::kOk) return ok();
  return fail(Status(r->status, std::to_string(r->blocks.size() - r->done) + " of " + std::to_string(r->blocks.size()) +
                                    " blocks failed (see the per-block statuses)"));
}

int req_out(const kvferry::Result<uint64_t>& r, uint64_t* req) {
  if (!r.ok()) return fail(r.status());
  *req = *r;
  return ok();
}

int region_spec(const kvferry_region_params* p, kvferry::KvCacheSpec* s) {
  if (p->field_mask & ~uint64_t{KVFERRY_REGION_F_ALL_V4})
    return fail(Status(ErrorCode::kVersionMismatch, "region params carry fields this library (abi " +
                                                        std::to_string(KVFERRY_ABI_VERSION) + ") does not know"));
  KVFERRY_C_CHECK(p->field_mask & KVFERRY_REGION_F_SPEC, "region params without KVFERRY_REGION_F_SPEC");
  KVFERRY_C_CHECK(p->name && p->format, "region params: name or format is NULL");
  KVFERRY_C_CHECK(p->layout == 0 || p->layout == 1, "layout must be 0 (block_major) or 1 (layer_major)");
  auto f = kvferry::EntryFormat::parse(p->format);
  if (!f.ok()) return fail(f.status());
  *s = kvferry::KvCacheSpec{p->layers, p->blocks, p->block_size, *f, static_cast<kvferry::Layout>(p->layout)};
  return 0;
}

// kvferry_daemon_status_json's text (the fields of `kvferry status --json`). Written by nlohmann:
// names of any length and with control characters stay valid JSON (bad UTF-8 becomes U+FFFD).
std::string status_json(const kvferry::proto::StatusReply& s) {
  using J = nlohmann::ordered_json;
  J regions = J::array(), clients = J::array();
  for (const auto& r : s.regions)
    regions.push_back({{"id", r.desc.id},
                       {"name", r.desc.name},
                       {"layers", r.desc.spec.layers},
                       {"blocks", r.desc.spec.blocks},
                       {"block_size", r.desc.spec.block_size},
                       {"format", r.desc.spec.format.name()},
                       {"layout", r.desc.spec.layout == kvferry::Layout::kBlockMajor ? "block_major" : "layer_major"},
                       {"bytes", r.desc.bytes},
                       {"backend", std::string(kvferry::proto::backend_name(r.desc.backend))},
                       {"device", r.desc.device},
                       {"holders", r.holders},
                       {"from_config", r.from_config}});
  for (const auto& c : s.clients)
    clients.push_back({{"id", c.id}, {"name", c.name}, {"pid", c.pid}, {"uid", c.uid}, {"ops", c.ops}});
  const J j = {{"version", s.version}, {"uptime_s", s.uptime_ms / 1000.0}, {"pid", s.pid},
               {"backend", s.backend}, {"regions", std::move(regions)},    {"clients", std::move(clients)}};
  return j.dump(-1, ' ', false, J::error_handler_t::replace);
}

}  // namespace

extern "C" {

const char* kvferry_last_error(void) { return g_last_error.c_str(); }

const char* kvferry_status_name(int status) {
  if (status < 0 || status >= KVFERRY_ERROR_COUNT) return "unknown";
  return kvferry::error_code_name(static_cast<ErrorCode>(status)).data();
}

const char* kvferry_version(void) { return kVersionText; }
uint32_t kvferry_abi_version(void) { return KVFERRY_ABI_VERSION; }
uint32_t kvferry_protocol_version(void) { return kvferry::proto::kVersion; }

int kvferry_connect(const char* socket, const char* client_name, kvferry_client** out) {
  return guard([&] {
    KVFERRY_C_CHECK(out, "out is NULL");
    *out = nullptr;
    kvferry::Client::Options o;
    if (socket) o.socket = socket;
    if (client_name) o.name = client_name;
    auto c = kvferry::Client::connect(o);
    if (!c.ok()) return fail(c.status());
    *out = new kvferry_client{std::move(*c)};
    return ok();
  });
}

void kvferry_close(kvferry_client* c) {
  try {
    delete c;
  } catch (...) {
  }
}

int kvferry_client_id(kvferry_client* c, uint32_t* out) {
  return guard([&] {
    KVFERRY_C_CHECK(c && out, "client or out is NULL");
    *out = c->c->id();
    return ok();
  });
}

int kvferry_region_count(kvferry_client* c, uint32_t* out) {
  return guard([&] {
    KVFERRY_C_CHECK(c && out, "client or out is NULL");
    *out = static_cast<uint32_t>(c->c->regions().size());
    return ok();
  });
}

int kvferry_get_region_info(kvferry_client* c, uint32_t index, kvferry_region_info* out) {
  return guard([&] {
    KVFERRY_C_CHECK(c && out, "client or out is NULL");
    auto rs = c->c->regions();
    if (index >= rs.size())
      return fail(
          Status(ErrorCode::kOutOfRange, "region index " + std::to_string(index) + " of " + std::to_string(rs.size())));
    const auto& d = rs[index];
    std::memset(out, 0, sizeof *out);
    out->id = d.id;
    std::strncpy(out->name, d.name.c_str(), sizeof out->name - 1);
    out->layers = d.spec.layers;
    out->blocks = d.spec.blocks;
    out->block_size = d.spec.block_size;
    std::strncpy(out->format, d.spec.format.name().c_str(), sizeof out->format - 1);
    out->layout = static_cast<int32_t>(d.spec.layout);
    out->bytes = d.bytes;
    out->backend = static_cast<int32_t>(d.backend);
    out->device = d.device;
    return ok();
  });
}

int kvferry_find_region(kvferry_client* c, const char* name, uint32_t* region_id) {
  return guard([&] {
    KVFERRY_C_CHECK(c && name && region_id, "client, name or region_id is NULL");
    auto r = c->c->find_region(name);
    if (!r.ok()) return fail(r.status());
    *region_id = *r;
    return ok();
  });
}

int kvferry_map_region(kvferry_client* c, uint32_t region_id, void** base) {
  return guard([&] {
    KVFERRY_C_CHECK(c && base, "client or base is NULL");
    auto r = c->c->map_region(region_id);
    if (!r.ok()) return fail(r.status());
    *base = *r;
    return ok();
  });
}

int kvferry_create_region(kvferry_client* c, const char* name, int64_t layers, int64_t blocks, int64_t block_size,
                          const char* format, int32_t layout, uint32_t* region_id) {
  return guard([&] {
    KVFERRY_C_CHECK(c && name && format && region_id, "client, name, format or region_id is NULL");
    KVFERRY_C_CHECK(layout == 0 || layout == 1, "layout must be 0 (block_major) or 1 (layer_major)");
    auto f = kvferry::EntryFormat::parse(format);
    if (!f.ok()) return fail(f.status());
    kvferry::KvCacheSpec s{layers, blocks, block_size, *f, static_cast<kvferry::Layout>(layout)};
    auto r = c->c->create_region(name, s);
    if (!r.ok()) return fail(r.status());
    *region_id = *r;
    return ok();
  });
}

int kvferry_register_region(kvferry_client* c, const char* name, int64_t layers, int64_t blocks, int64_t block_size,
                            const char* format, int32_t layout, int32_t backend, int fd, const uint8_t* ipc_handle,
                            void* base, uint64_t alloc_bytes, int32_t device, uint32_t* region_id) {
  return guard([&] {
    KVFERRY_C_CHECK(c && name && format && region_id, "client, name, format or region_id is NULL");
    KVFERRY_C_CHECK(layout == 0 || layout == 1, "layout must be 0 (block_major) or 1 (layer_major)");
    KVFERRY_C_CHECK(backend >= 0 && backend <= 2, "backend must be 0 (memfd), 1 (cuda_vmm) or 2 (cuda_ipc)");
    auto f = kvferry::EntryFormat::parse(format);
    if (!f.ok()) return fail(f.status());
    kvferry::KvCacheSpec s{layers, blocks, block_size, *f, static_cast<kvferry::Layout>(layout)};
    kvferry::Client::OwnBuffer b;
    b.backend = static_cast<kvferry::proto::Backend>(backend);
    b.fd = fd;
    b.ipc_handle = ipc_handle;
    b.base = base;
    b.alloc_bytes = alloc_bytes;
    b.device = device;
    auto r = c->c->register_region(name, s, b);
    if (!r.ok()) return fail(r.status());
    *region_id = *r;
    return ok();
  });
}

int kvferry_layer_view(kvferry_client* c, uint32_t region_id, int64_t layer, kvferry_view* out) {
  return guard([&] {
    KVFERRY_C_CHECK(c && out, "client or out is NULL");
    auto v = c->c->layer_view(region_id, layer);
    if (!v.ok()) return fail(v.status());
    to_c(*v, out);
    return ok();
  });
}

int kvferry_kv_view(kvferry_client* c, uint32_t region_id, int64_t layer, int32_t v_plane, kvferry_view* out) {
  return guard([&] {
    KVFERRY_C_CHECK(c && out, "client or out is NULL");
    auto v = c->c->kv_view(region_id, layer, v_plane != 0);
    if (!v.ok()) return fail(v.status());
    to_c(*v, out);
    return ok();
  });
}

int kvferry_submit(kvferry_client* c, const kvferry_sqe* req) {
  return guard([&] {
    KVFERRY_C_CHECK(c && req, "client or req is NULL");
    kvferry::ring::SubmitEntry e{};
    std::memcpy(&e, req, sizeof e);
    Status st = c->c->submit(e);
    return st.ok() ? ok() : fail(st);
  });
}

int kvferry_ping(kvferry_client* c, uint64_t id, uint64_t payload) {
  return guard([&] {
    KVFERRY_C_CHECK(c, "client is NULL");
    Status st = c->c->ping(id, payload);
    return st.ok() ? ok() : fail(st);
  });
}

int kvferry_poll(kvferry_client* c, kvferry_cqe* out, uint32_t max, uint32_t* n) {
  return guard([&] {
    KVFERRY_C_CHECK(c && n && (out || max == 0), "client, out or n is NULL");
    std::vector<kvferry::ring::CompletionEntry> buf(max);
    *n = static_cast<uint32_t>(c->c->poll(buf));
    std::memcpy(out, buf.data(), *n * sizeof(kvferry_cqe));
    return ok();
  });
}

int kvferry_wait(kvferry_client* c, kvferry_cqe* out, uint32_t max, int64_t timeout_us, uint32_t* n) {
  return guard([&] {
    KVFERRY_C_CHECK(c && n && out && max > 0, "client, out or n is NULL, or max is 0");
    *n = 0;
    std::vector<kvferry::ring::CompletionEntry> buf(max);
    auto r = c->c->wait(buf, timeout_us);
    if (!r.ok()) return fail(r.status());
    *n = static_cast<uint32_t>(*r);
    std::memcpy(out, buf.data(), *n * sizeof(kvferry_cqe));
    return ok();
  });
}

int kvferry_arena(kvferry_client* c, void** base, uint32_t* bytes) {
  return guard([&] {
    KVFERRY_C_CHECK(c && base && bytes, "client, base or bytes is NULL");
    auto a = c->c->arena();
    *base = a.data();
    *bytes = static_cast<uint32_t>(a.size());
    return ok();
  });
}

int kvferry_debug_read(kvferry_client* c, uint32_t region_id, uint64_t offset, void* dst, uint32_t bytes) {
  return guard([&] {
    KVFERRY_C_CHECK(c && (dst || bytes == 0), "client or dst is NULL");
    auto r = c->c->debug_read(region_id, offset, bytes);
    if (!r.ok()) return fail(r.status());
    std::memcpy(dst, r->data(), bytes);
    return ok();
  });
}

int kvferry_connect_ns(const char* socket, const char* client_name, const char* model, const char* tenant,
                       kvferry_client** out) {
  return guard([&] {
    KVFERRY_C_CHECK(out, "out is NULL");
    *out = nullptr;
    kvferry::Client::Options o;
    if (socket) o.socket = socket;
    if (client_name) o.name = client_name;
    if (model) o.model = model;
    if (tenant) o.tenant = tenant;
    auto c = kvferry::Client::connect(o);
    if (!c.ok()) return fail(c.status());
    *out = new kvferry_client{std::move(*c)};
    return ok();
  });
}

int kvferry_submit_lookup(kvferry_client* c, uint32_t region_id, const kvferry_key* keys, uint32_t n, uint64_t* req) {
  return guard([&] {
    KVFERRY_C_CHECK(c && req && (keys || n == 0), "client, keys or req is NULL");
    return req_out(c->c->submit_lookup(region_id, key_span(keys, n)), req);
  });
}

int kvferry_submit_save(kvferry_client* c, uint32_t region_id, const kvferry_key* keys, const int64_t* block_ids,
                        uint32_t n, uint64_t* req) {
  return guard([&] {
    KVFERRY_C_CHECK(c && req && ((keys && block_ids) || n == 0), "client, keys, block_ids or req is NULL");
    return req_out(c->c->submit_save(region_id, key_span(keys, n), {block_ids, n}), req);
  });
}

int kvferry_submit_load(kvferry_client* c, uint32_t region_id, const kvferry_key* keys, const int64_t* block_ids,
                        uint32_t n, uint64_t* req) {
  return guard([&] {
    KVFERRY_C_CHECK(c && req && ((keys && block_ids) || n == 0), "client, keys, block_ids or req is NULL");
    return req_out(c->c->submit_load(region_id, key_span(keys, n), {block_ids, n}), req);
  });
}

int kvferry_wait_op(kvferry_client* c, uint64_t req, int64_t timeout_us, int16_t* statuses, uint32_t max_statuses,
                    uint32_t* done, uint64_t* result) {
  return guard([&] {
    KVFERRY_C_CHECK(c, "client is NULL");
    return op_out(c->c->wait_op(req, timeout_us), statuses, max_statuses, done, result);
  });
}

int kvferry_lookup(kvferry_client* c, uint32_t region_id, const kvferry_key* keys, uint32_t n, int16_t* statuses,
                   uint32_t* prefix) {
  return guard([&] {
    KVFERRY_C_CHECK(c && (keys || n == 0), "client or keys is NULL");
    auto r = c->c->lookup(region_id, key_span(keys, n));
    if (!r.ok()) return fail(r.status());
    if (r->status != ErrorCode::kOk && r->blocks.empty())  // the request itself failed (e.g. no such region)
      return fail(Status(r->status, "lookup in region " + std::to_string(region_id) + " failed"));
    if (prefix) *prefix = static_cast<uint32_t>(r->result[0]);
    if (statuses)
      for (size_t i = 0; i < r->blocks.size() && i < n; ++i) statuses[i] = static_cast<int16_t>(r->blocks[i]);
    return ok();  // misses are answers, not failures
  });
}

int kvferry_save(kvferry_client* c, uint32_t region_id, const kvferry_key* keys, const int64_t* block_ids, uint32_t n,
                 int16_t* statuses, uint32_t* done) {
  return guard([&] {
    KVFERRY_C_CHECK(c && ((keys && block_ids) || n == 0), "client, keys or block_ids is NULL");
    return op_out(c->c->save(region_id, key_span(keys, n), {block_ids, n}), statuses, n, done, nullptr);
  });
}

int kvferry_load(kvferry_client* c, uint32_t region_id, const kvferry_key* keys, const int64_t* block_ids, uint32_t n,
                 int16_t* statuses, uint32_t* done) {
  return guard([&] {
    KVFERRY_C_CHECK(c && ((keys && block_ids) || n == 0), "client, keys or block_ids is NULL");
    return op_out(c->c->load(region_id, key_span(keys, n), {block_ids, n}), statuses, n, done, nullptr);
  });
}

int kvferry_submit_load_mapped(kvferry_client* c, uint32_t region_id, const kvferry_key* keys, const int64_t* block_ids,
                               const int32_t* parts, uint32_t n, uint64_t* req) {
  return guard([&] {
    KVFERRY_C_CHECK(c && req && ((keys && block_ids && parts) || n == 0),
                    "client, keys, block_ids, parts or req is NULL");
    return req_out(c->c->submit_load_mapped(region_id, key_span(keys, n), {block_ids, n}, {parts, n}), req);
  });
}

int kvferry_load_mapped(kvferry_client* c, uint32_t region_id, const kvferry_key* keys, const int64_t* block_ids,
                        const int32_t* parts, uint32_t n, int16_t* statuses, uint32_t* done) {
  return guard([&] {
    KVFERRY_C_CHECK(c && ((keys && block_ids && parts) || n == 0), "client, keys, block_ids or parts is NULL");
    return op_out(c->c->load_mapped(region_id, key_span(keys, n), {block_ids, n}, {parts, n}), statuses, n, done,
                  nullptr);
  });
}

int kvferry_pin(kvferry_client* c, uint32_t region_id, const kvferry_key* keys, uint32_t n, int16_t* statuses,
                uint32_t* done) {
  return guard([&] {
    KVFERRY_C_CHECK(c && (keys || n == 0), "client or keys is NULL");
    return op_out(c->c->pin(region_id, key_span(keys, n)), statuses, n, done, nullptr);
  });
}

int kvferry_unpin(kvferry_client* c, uint32_t region_id, const kvferry_key* keys, uint32_t n, int16_t* statuses,
                  uint32_t* done) {
  return guard([&] {
    KVFERRY_C_CHECK(c && (keys || n == 0), "client or keys is NULL");
    return op_out(c->c->unpin(region_id, key_span(keys, n)), statuses, n, done, nullptr);
  });
}

int kvferry_evict(kvferry_client* c, uint32_t region_id, const kvferry_key* keys, uint32_t n, uint64_t flags,
                  int16_t* statuses, uint64_t* evicted) {
  return guard([&] {
    KVFERRY_C_CHECK(c && (keys || n == 0 || flags), "client or keys is NULL");
    uint64_t res[5] = {};
    const int rc = op_out(c->c->evict(region_id, key_span(keys, flags ? 0 : n), flags), statuses, n, nullptr, res);
    if (evicted) *evicted = res[0];
    return rc;
  });
}

int kvferry_stats(kvferry_client* c, kvferry_stats_info* out) {
  return guard([&] {
    KVFERRY_C_CHECK(c && out, "client or out is NULL");
    auto r = c->c->stats();
    if (!r.ok()) return fail(r.status());
    std::memcpy(out, &*r, sizeof *out);
    return ok();
  });
}

int kvferry_ls(kvferry_client* c, uint32_t region_id, kvferry_ls_entry* out, uint32_t max, uint32_t* n) {
  return guard([&] {
    KVFERRY_C_CHECK(c && n && (out || max == 0), "client, out or n is NULL");
    *n = 0;
    if (max == 0) return ok();
    auto r = c->c->ls(region_id, max);
    if (!r.ok()) return fail(r.status());
    const size_t k = std::min<size_t>(r->size(), max);
    if (k) std::memcpy(out, r->data(), k * sizeof(kvferry_ls_entry));
    *n = static_cast<uint32_t>(k);
    return ok();
  });
}

int kvferry_connection_status(kvferry_client* c) {
  return guard([&] {
    KVFERRY_C_CHECK(c, "client is NULL");
    Status st = c->c->connection_status();
    return st.ok() ? ok() : fail(st);
  });
}

int kvferry_connect_with(const kvferry_connect_params* p, kvferry_client** out) {
  return guard([&] {
    KVFERRY_C_CHECK(p && out, "params or out is NULL");
    *out = nullptr;
    if (p->field_mask & ~uint64_t{KVFERRY_CONNECT_F_ALL_V2})
      return fail(Status(ErrorCode::kVersionMismatch, "connect params carry fields this library (abi " +
                                                          std::to_string(KVFERRY_ABI_VERSION) + ") does not know"));
    if ((p->field_mask & KVFERRY_CONNECT_F_ABI_VERSION) && p->abi_version > KVFERRY_ABI_VERSION)
      return fail(Status(ErrorCode::kVersionMismatch, "the caller was built against kvferry.h abi " +
                                                          std::to_string(p->abi_version) + ", this libkvferry is abi " +
                                                          std::to_string(KVFERRY_ABI_VERSION) + ": update libkvferry"));
    kvferry::Client::Options o;
    if ((p->field_mask & KVFERRY_CONNECT_F_SOCKET) && p->socket) o.socket = p->socket;
    if ((p->field_mask & KVFERRY_CONNECT_F_CLIENT_NAME) && p->client_name) o.name = p->client_name;
    if (p->field_mask & KVFERRY_CONNECT_F_NAMESPACE) {
      if (p->model) o.model = p->model;
      if (p->tenant) o.tenant = p->tenant;
    }
    if (p->field_mask & KVFERRY_CONNECT_F_TIMEOUT_MS) {
      KVFERRY_C_CHECK(p->timeout_ms > 0, "timeout_ms must be positive");
      o.timeout_ms = p->timeout_ms;
    }
    if (p->field_mask & KVFERRY_CONNECT_F_SPIN_US) {
      KVFERRY_C_CHECK(p->spin_us >= 0, "spin_us must not be negative");
      o.spin_us = p->spin_us;
    }
    auto c = kvferry::Client::connect(o);
    if (!c.ok()) return fail(c.status());
    *out = new kvferry_client{std::move(*c)};
    return ok();
  });
}

int kvferry_create_region_with(kvferry_client* c, const kvferry_region_params* p, uint32_t* region_id) {
  return guard([&] {
    KVFERRY_C_CHECK(c && p && region_id, "client, params or region_id is NULL");
    kvferry::KvCacheSpec s;
    if (int rc = region_spec(p, &s)) return rc;
    auto r = c->c->create_region(p->name, s);
    if (!r.ok()) return fail(r.status());
    *region_id = *r;
    return ok();
  });
}

int kvferry_register_region_with(kvferry_client* c, const kvferry_region_params* p, uint32_t* region_id) {
  return guard([&] {
    KVFERRY_C_CHECK(c && p && region_id, "client, params or region_id is NULL");
    kvferry::KvCacheSpec s;
    if (int rc = region_spec(p, &s)) return rc;
    KVFERRY_C_CHECK(p->field_mask & KVFERRY_REGION_F_BUFFER, "register: region params without KVFERRY_REGION_F_BUFFER");
    KVFERRY_C_CHECK(p->backend >= 0 && p->backend <= 2, "backend must be 0 (memfd), 1 (cuda_vmm) or 2 (cuda_ipc)");
    kvferry::Client::OwnBuffer b;
    b.backend = static_cast<kvferry::proto::Backend>(p->backend);
    b.fd = p->fd;
    b.ipc_handle = p->ipc_handle;
    b.base = p->base;
    b.alloc_bytes = p->alloc_bytes;
    b.device = p->device;
    if (p->field_mask & KVFERRY_REGION_F_OFFSET) b.offset = p->offset;
    auto r = c->c->register_region(p->name, s, b);
    if (!r.ok()) return fail(r.status());
    *region_id = *r;
    return ok();
  });
}

int kvferry_describe_region(kvferry_client* c, uint32_t region_id, kvferry_region_desc* out) {
  return guard([&] {
    KVFERRY_C_CHECK(c && out, "client or out is NULL");
    const uint64_t want = out->field_mask & KVFERRY_REGION_DESC_F_ALL_V2;
    const auto rs = c->c->regions();
    auto it = std::find_if(rs.begin(), rs.end(), [&](const auto& d) { return d.id == region_id; });
    if (it == rs.end())
      return fail(Status(ErrorCode::kNotFound, "region " + std::to_string(region_id) + " is unknown to this client"));
    const auto& d = *it;
    out->field_mask = 0;
    if (want & KVFERRY_REGION_DESC_F_BASIC) {
      out->id = d.id;
      out->layout = static_cast<int32_t>(d.spec.layout);
      std::memset(out->name, 0, sizeof out->name);
      std::strncpy(out->name, d.name.c_str(), sizeof out->name - 1);
      std::memset(out->format, 0, sizeof out->format);
      std::strncpy(out->format, d.spec.format.name().c_str(), sizeof out->format - 1);
      out->layers = d.spec.layers;
      out->blocks = d.spec.blocks;
      out->block_size = d.spec.block_size;
      out->bytes = d.bytes;
      out->backend = static_cast<int32_t>(d.backend);
      out->device = d.device;
      out->field_mask |= KVFERRY_REGION_DESC_F_BASIC;
    }
    if (want & KVFERRY_REGION_DESC_F_MAPPING) {
      out->base = c->c->mapped_base(region_id);
      out->mapped = out->base ? 1 : 0;
      out->reserved = 0;
      out->block_bytes = static_cast<uint64_t>(d.spec.block_bytes());
      out->field_mask |= KVFERRY_REGION_DESC_F_MAPPING;
    }
    return ok();
  });
}

int kvferry_get_stats(kvferry_client* c, kvferry_store_stats* out) {
  return guard([&] {
    KVFERRY_C_CHECK(c && out, "client or out is NULL");
    const uint64_t want = out->field_mask & KVFERRY_STATS_F_ALL_V2;
    out->field_mask = 0;
    if (!want) return ok();
    auto r = c->c->stats();
    if (!r.ok()) return fail(r.status());
    std::memcpy(&out->entries, &*r, sizeof *r);
    out->field_mask = KVFERRY_STATS_F_STORE;
    return ok();
  });
}

int kvferry_daemon_status_json(kvferry_client* c, char* buf, uint32_t cap, uint32_t* needed) {
  return guard([&] {
    KVFERRY_C_CHECK(c && needed && (buf || cap == 0), "client, buf or needed is NULL");
    auto r = c->c->status();
    if (!r.ok()) return fail(r.status());
    const std::string j = status_json(*r);
    *needed = static_cast<uint32_t>(j.size() + 1);
    if (cap < j.size() + 1)
      return fail(Status(ErrorCode::kOutOfRange, "the status needs " + std::to_string(j.size() + 1) + " bytes"));
    std::memcpy(buf, j.c_str(), j.size() + 1);
    return ok();
  });
}

int kvferry_send(kvferry_client* c, uint32_t region_id, const kvferry_key* keys, const int64_t* block_ids, uint32_t n,
                 const char* peer, int16_t* statuses, uint32_t* done) {
  return guard([&] {
    KVFERRY_C_CHECK(c && peer && ((keys && block_ids) || n == 0), "client, peer, keys or block_ids is NULL");
    auto r = c->c->send(region_id, key_span(keys, n), {block_ids, n}, peer);
    if (r.ok() && r->status == ErrorCode::kUnavailable && r->blocks.empty())
      return fail(Status(ErrorCode::kUnavailable, "the daemon has no remote tier (tiers.remote.listen is not set)"));
    return op_out(r, statuses, n, done, nullptr);
  });
}

int kvferry_send_into(kvferry_client* c, uint32_t region_id, const kvferry_key* keys, const int64_t* block_ids,
                      uint32_t n, const char* peer, uint32_t peer_region, const int64_t* peer_block_ids,
                      int16_t* statuses, uint32_t* done) {
  return guard([&] {
    KVFERRY_C_CHECK(c && peer && ((keys && block_ids && peer_block_ids) || n == 0),
                    "client, peer, keys, block_ids or peer_block_ids is NULL");
    KVFERRY_C_CHECK(peer_region != 0, "peer_region is 0 (use kvferry_send for the peer's pool only)");
    auto r = c->c->send_into(region_id, key_span(keys, n), {block_ids, n}, peer, peer_region, {peer_block_ids, n});
    if (r.ok() && r->status == ErrorCode::kUnavailable && r->blocks.empty())
      return fail(Status(ErrorCode::kUnavailable, "the daemon has no remote tier (tiers.remote.listen is not set)"));
    return op_out(r, statuses, n, done, nullptr);
  });
}

int kvferry_lookup_wait(kvferry_client* c, uint32_t region_id, const kvferry_key* keys, uint32_t n, uint32_t wait_ms,
                        int16_t* statuses, uint32_t* prefix) {
  return guard([&] {
    KVFERRY_C_CHECK(c && (keys || n == 0), "client or keys is NULL");
    auto r = c->c->lookup_wait(region_id, key_span(keys, n), wait_ms);
    if (!r.ok()) return fail(r.status());
    if (r->status != ErrorCode::kOk && r->blocks.empty())
      return fail(Status(r->status, "lookup in region " + std::to_string(region_id) + " failed"));
    if (prefix) *prefix = static_cast<uint32_t>(r->result[0]);
    if (statuses)
      for (size_t i = 0; i < r->blocks.size() && i < n; ++i) statuses[i] = static_cast<int16_t>(r->blocks[i]);
    return ok();
  });
}

int kvferry_peers_json(kvferry_client* c, char* buf, uint32_t cap, uint32_t* needed) {
  return guard([&] {
    KVFERRY_C_CHECK(c && needed && (buf || cap == 0), "client, buf or needed is NULL");
    auto r = c->c->peers();
    if (!r.ok()) return fail(r.status());
    *needed = static_cast<uint32_t>(r->size() + 1);
    if (cap < r->size() + 1)
      return fail(Status(ErrorCode::kOutOfRange, "the peers list needs " + std::to_string(r->size() + 1) + " bytes"));
    std::memcpy(buf, r->c_str(), r->size() + 1);
    return ok();
  });
}

int kvferry_get_tier_stats(kvferry_client* c, kvferry_tier_stats* out, uint32_t max, uint32_t* n) {
  return guard([&] {
    KVFERRY_C_CHECK(c && n && (out || max == 0), "client, out or n is NULL");
    *n = 0;
    if (max == 0) return ok();
    auto r = c->c->stats_all();
    if (!r.ok()) return fail(r.status());
    const size_t k = std::min<size_t>(r->tiers.size(), max);
    for (size_t i = 0; i < k; ++i) {
      const kvferry::ops::TierStatsWire& t = r->tiers[i];
      kvferry_tier_stats& o = out[i];
      const uint64_t want = o.field_mask & KVFERRY_TIER_F_ALL_V3;
      o.field_mask = 0;
      if (want & KVFERRY_TIER_F_BASIC) {
        std::memcpy(o.tier, t.tier, sizeof o.tier);
        o.healthy = (t.flags & kvferry::ops::kTierHealthy) ? 1 : 0;
        o.reserved = 0;
        std::memcpy(o.reason, t.reason, sizeof o.reason);
        o.field_mask |= KVFERRY_TIER_F_BASIC;
      }
      if ((want & KVFERRY_TIER_F_STORAGE) && (t.flags & kvferry::ops::kTierStorage)) {
        o.capacity_bytes = t.capacity_bytes;
        o.used_bytes = t.used_bytes;
        o.blocks = t.blocks;
        o.pinned = t.pinned;
        o.evictions = t.evictions;
        o.io_errors = t.io_errors;
        o.checksum_failures = t.checksum_failures;
        o.bytes_written = t.bytes_written;
        o.bytes_read = t.bytes_read;
        o.field_mask |= KVFERRY_TIER_F_STORAGE;
      }
      if ((want & KVFERRY_TIER_F_PEERS) && (t.flags & kvferry::ops::kTierPeers)) {
        std::memcpy(o.member, t.member, sizeof o.member);
        o.peers_live = t.peers_live;
        o.peers_lost = t.peers_lost;
        o.blocks_out = t.blocks_out;
        o.bytes_out = t.bytes_out;
        o.blocks_in = t.blocks_in;
        o.bytes_in = t.bytes_in;
        o.errors = t.errors;
        o.field_mask |= KVFERRY_TIER_F_PEERS;
      }
    }
    *n = static_cast<uint32_t>(k);
    return ok();
  });
}

}  // extern "C"

// LocalSender (local_send.h): imports of peers' regions and the copies into them.
#include "local_send.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <tuple>

#include "kvferry/connector/client.h"
#include "kvferry/connector/cuda_vmm.h"
#include "kvferry/kernels/copy_blocks.h"
#include "kvferry/kernels/device.h"
#include "kvferry/store/remote_store.h"

#if defined(KVFERRY_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace kvferry::daemon {

namespace {

using std::chrono::milliseconds;

/// How long a peer that cannot be reached region to region (another host, no export, a socket or
/// an import that fails here) goes through the host pools before this daemon asks again.
constexpr auto kRetryElsewhere = std::chrono::seconds(30);

/// Most runs one BlockCopier::copy takes (a layer-major send has blocks x layers runs).
constexpr int64_t kMaxRuns = 8192;

/// Errors that say the import is stale or its peer gone: the next send imports again.
bool import_failure(ErrorCode c) {
  return c == ErrorCode::kUnavailable || c == ErrorCode::kNotFound || c == ErrorCode::kPermissionDenied ||
         c == ErrorCode::kTimeout || c == ErrorCode::kProtocol;
}

}  // namespace

/// A stream and a copier per device, made on the first send from it and kept (a copier's pinned
/// run arrays and a stream cost milliseconds to make: more than a send of a few hundred MiB
/// takes). Sends from one device take turns on its lane.
struct LocalSender::Lanes {
#if defined(KVFERRY_WITH_CUDA)
  struct Lane {
    std::mutex mu;
    cudaStream_t stream = nullptr;
    std::unique_ptr<kernels::BlockCopier> copier;
    ~Lane() {
      if (stream) {
        (void)cudaStreamSynchronize(stream);
        copier.reset();
        (void)cudaStreamDestroy(stream);
      }
    }
  };
  std::mutex mu;
  std::map<int, std::unique_ptr<Lane>> by_device;

  /// Device-to-device DMA of `runs` from `src` to `dst` on `device`'s lane, waited for.
  Status copy(int device, const uint8_t* src, uint8_t* dst, std::span<const CopyRun> runs) {
    Lane* lane = nullptr;
    {
      std::lock_guard g(mu);
      auto& l = by_device[device];
      if (!l) l = std::make_unique<Lane>();
      lane = l.get();
    }
    std::lock_guard g(lane->mu);
    int prev = -1;
    (void)cudaGetDevice(&prev);
    struct Restore {
      int d;
      ~Restore() {
        if (d >= 0) (void)cudaSetDevice(d);
      }
    } restore{prev};
    KVFERRY_CUDA_TRY(cudaSetDevice(device));
    if (!lane->stream) {
      KVFERRY_ASSIGN_OR_RETURN(lane->copier, kernels::BlockCopier::create(kMaxRuns));
      KVFERRY_CUDA_TRY(cudaStreamCreateWithFlags(&lane->stream, cudaStreamNonBlocking));
    }
    Status st = Status::Ok();
    for (size_t a = 0; a < runs.size() && st.ok(); a += static_cast<size_t>(kMaxRuns)) {
      const size_t n = std::min(runs.size() - a, static_cast<size_t>(kMaxRuns));
      st = lane->copier->copy(src, dst, runs.subspan(a, n), kernels::CopyEngine::kDma, lane->stream);
    }
    const Status sync = KVFERRY_CUDA_STATUS(cudaStreamSynchronize(lane->stream));
    return st.ok() ? sync : st;
  }
#endif
};

struct LocalSender::Import {
  std::unique_ptr<Client> client;  // the session on the peer's socket that maps the region
  uint8_t* base = nullptr;         // the region in this process (device pointer for GPU regions)
  proto::RegionDesc desc;
  std::string token;
  bool device = false;
  std::atomic<int> reach{-1};  // the sending device granted access to this GPU mapping (another GPU's memory)
};

LocalSender::LocalSender(store::RemoteStore& remote, std::string name)
    : remote_(remote), name_(std::move(name)), lanes_(std::make_unique<Lanes>()) {}
LocalSender::~LocalSender() = default;

uint64_t LocalSender::blocks_sent() const {
  std::lock_guard g(mu_);
  return blocks_;
}

void LocalSender::forget(const std::string& peer, const std::string& ns_name, uint32_t region) {
  std::lock_guard g(mu_);
  imports_.erase({peer, ns_name, region});
}

Result<std::shared_ptr<LocalSender::Import>> LocalSender::import(const std::string& peer, const std::string& ns_name,
                                                                 uint32_t region, Clock::time_point deadline,
                                                                 bool* fall_back) {
  *fall_back = false;
  {
    std::lock_guard g(mu_);
    if (auto it = imports_.find({peer, ns_name, region}); it != imports_.end()) return it->second;
    if (auto it = elsewhere_.find(peer); it != elsewhere_.end() && Clock::now() < it->second) {
      *fall_back = true;
      return Status(ErrorCode::kUnsupported, peer + " is not reachable region to region");
    }
  }
  // Anything that says "not here" (another host, no export, a socket or memory this process cannot
  // reach) sends this peer's blocks through the host pools for a while; a region the peer does not
  // have, or a peer that is lost, fails the blocks as the host-pool path would.
  auto elsewhere = [&](const Status& why) -> Status {
    spdlog::info("remote tier: sends into {}'s regions go through the host pools: {}", peer, why.to_string());
    std::lock_guard g(mu_);
    elsewhere_[peer] = Clock::now() + kRetryElsewhere;
    *fall_back = true;
    return why;
  };
  auto grant = remote_.local_import(peer, ns_name, region, deadline);
  if (!grant.ok()) {
    if (grant.status().code() == ErrorCode::kUnsupported) return elsewhere(grant.status());
    return grant.status();
  }
  Client::Options o;
  o.socket = grant->socket;
  o.name = "peer:" + name_;
  o.peer_token = grant->token;
  o.timeout_ms = static_cast<int>(
      std::clamp<int64_t>(std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count(), 100, 5000));
  auto client = Client::connect(o);
  if (!client.ok()) return elsewhere(client.status().with_context("connecting to " + grant->socket));
  auto base = (*client)->map_region(region);
  if (!base.ok()) {
    if (base.status().code() == ErrorCode::kNotFound || base.status().code() == ErrorCode::kPermissionDenied)
      return base.status();
    return elsewhere(base.status().with_context("mapping region " + std::to_string(region) + " of " + peer));
  }
  auto imp = std::make_shared<Import>();
  imp->base = static_cast<uint8_t*>(*base);
  imp->token = grant->token;
  for (const auto& d : (*client)->regions())
    if (d.id == region) imp->desc = d;
  imp->device = imp->desc.backend != proto::Backend::kMemfd;
  imp->client = std::move(*client);
  spdlog::info("remote tier: imported region {} '{}' of {} ({}, {}) for region-to-region sends", region, imp->desc.name,
               peer, imp->desc.spec.format.name(), imp->device ? "GPU memory" : "host memory");
  std::lock_guard g(mu_);
  return imports_.try_emplace({peer, ns_name, region}, imp).first->second;
}

std::optional<std::vector<Status>> LocalSender::send(const Region& src, const std::string& ns_name,
                                                     const std::string& peer, uint32_t peer_region,
                                                     std::span<const store::BlockKey> keys,
                                                     std::span<const int64_t> ids, std::span<const int64_t> peer_ids,
                                                     Clock::time_point deadline) {
  const size_t n = keys.size();
  bool fall_back = false;
  auto imp = import(peer, ns_name, peer_region, deadline, &fall_back);
  if (!imp.ok()) {
    if (fall_back) return std::nullopt;
    return std::vector<Status>(n, imp.status());
  }
  const KvCacheSpec& a = src.desc().spec;
  const KvCacheSpec& b = (*imp)->desc.spec;
  // A conversion, or host memory on one side and GPU memory on the other: through the host pools.
  if (!(a.format == b.format) || a.block_size != b.block_size || a.layers != b.layers ||
      src.on_device() != (*imp)->device)
    return std::nullopt;

  // Another GPU of this host: the sending GPU's copy engines write into it over NVLink, which a
  // cuMem mapping must allow (an IPC mapping was opened with lazy peer access). GPUs without peer
  // access go through the host pools.
  if (src.on_device() && (*imp)->reach != src.desc().device) {
    if ((*imp)->desc.backend == proto::Backend::kCudaVmm) {
      if (Status st = cuda_vmm::grant_access((*imp)->base, (*imp)->desc.device, src.desc().device); !st.ok()) {
        spdlog::info("remote tier: sends into region {} of {} go through the host pools: {}", peer_region, peer,
                     st.to_string());
        return std::nullopt;
      }
    }
    (*imp)->reach = src.desc().device;
  }
  std::vector<Status> out(n, Status::Ok());
  std::vector<CopyRun> runs;
  std::vector<size_t> go;
  go.reserve(n);
  const int64_t page = a.page_bytes();
  for (size_t i = 0; i < n; ++i) {
    if (Status s = a.check_block(ids[i]); !s.ok()) {
      out[i] = s.with_context("this daemon's region");
      continue;
    }
    if (Status s = b.check_block(peer_ids[i]); !s.ok()) {
      out[i] = s.with_context("region " + std::to_string(peer_region) + " of " + peer);
      continue;
    }
    go.push_back(i);
    for (int64_t l = 0; l < a.layers; ++l) {
      const CopyRun r{a.page_offset(l, ids[i]), b.page_offset(l, peer_ids[i]), page};
      if (!runs.empty() && runs.back().src + runs.back().bytes == r.src && runs.back().dst + runs.back().bytes == r.dst)
        runs.back().bytes += r.bytes;  // block-major: one run per block
      else
        runs.push_back(r);
    }
  }
  if (go.empty()) return out;
  Status copied = Status::Ok();
  if (src.on_device()) {
#if defined(KVFERRY_WITH_CUDA)
    copied = lanes_->copy(src.desc().device, src.base(), (*imp)->base, runs);
#else
    copied = Status(ErrorCode::kUnavailable, "kvferry was built without CUDA");
#endif
  } else {
    copied = kernels::copy_blocks_cpu(src.base(), a.region_bytes(), (*imp)->base, b.region_bytes(), runs);
  }
  if (!copied.ok()) {
    forget(peer, ns_name, peer_region);
    for (size_t i : go)
      out[i] = copied.with_context("copying into region " + std::to_string(peer_region) + " of " + peer);
    return out;
  }
  std::vector<store::BlockKey> k;
  std::vector<int64_t> to;
  k.reserve(go.size());
  to.reserve(go.size());
  for (size_t i : go) {
    k.push_back(keys[i]);
    to.push_back(peer_ids[i]);
  }
  const auto landed = remote_.local_landed(peer, ns_name, (*imp)->token, peer_region, k, to, deadline);
  uint64_t ok = 0;
  bool stale = false;
  for (size_t j = 0; j < go.size(); ++j) {
    out[go[j]] = j < landed.size() ? landed[j] : Status(ErrorCode::kInternal, "the landing returned too few statuses");
    ok += out[go[j]].ok() ? 1 : 0;
    stale = stale || (!out[go[j]].ok() && import_failure(out[go[j]].code()));
  }
  if (stale) forget(peer, ns_name, peer_region);
  std::lock_guard g(mu_);
  blocks_ += ok;
  return out;
}

}  // namespace kvferry::daemon

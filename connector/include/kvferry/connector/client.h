#pragma once
// The engine-side C++ client of kvferryd (DESIGN.md §5): connect over the control socket, map
// regions into this process (host memory or GPU memory), get per-layer views, and submit
// requests / reap completions over the shared-memory rings.
//
// Threads: every member function may be called from any thread. Control calls (map_region,
// create_region, debug_read, status) are serialized by one mutex; submissions by another (the
// submission ring stays single-producer); completions are reaped by one thread at a time, which
// files each for whoever waits on it, so a data op submitted on one thread while another thread
// waits is safe. poll()/wait() hand out only raw completions (of submit()/ping()); a data op's
// completion is always kept for its wait_op(), never handed to poll()/wait().
//
// A dead daemon: every wait (wait(), wait_op() and the synchronous data ops) also watches the
// control socket; when kvferryd closes it (crash, SIGKILL, shutdown) the waits return
// kUnavailable at once, every data op still in flight fails with kUnavailable, and later
// submissions fail with kUnavailable. Connect again (a new Client) to go on; what was lost is
// named in the error (ops in flight; pins and regions this client created are the daemon's).
//
// CUDA: calls that map or unmap GPU memory switch the calling thread's current device and
// restore it before they return.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "kvferry/connector/ops.h"
#include "kvferry/connector/protocol.h"
#include "kvferry/connector/ring.h"
#include "kvferry/connector/wire_io.h"
#include "kvferry/layouts/tensor_view.h"

namespace kvferry {

/// A per-layer view of a mapped region: `data` = region base + view.offset, so element
/// (b, t, e) is at data + (b*stride(0) + t*stride(1) + e*stride(2)) * elem_bytes.
struct LayerView {
  void* data = nullptr;
  TensorView view;         ///< sizes, strides (elements) and the byte offset from the region base
  bool on_device = false;  ///< GPU memory (CUDA backends) or host memory (memfd)
};

class Client {
 public:
  struct Options {
    std::string socket;  ///< "" = $KVFERRY_SOCKET, else /run/kvferry/kvferry.sock
    std::string name = "engine";
    int timeout_ms = 5000;  ///< bound on every control round trip
    int64_t spin_us = 50;   ///< wait(): spin this long before sleeping on the doorbell
    /// The block namespace (blocks are shared between clients of one model, tenant and format
    /// family, never across). "" model = the daemon's default namespace.
    std::string model;
    std::string tenant;
    /// Set only by a peer daemon importing a region (proto::Hello::peer_token).
    std::string peer_token;
  };

  /// The outcome of one data op (lookup, save, load, pin, unpin, evict, stats, ls).
  struct OpResult {
    ErrorCode status = ErrorCode::kOk;  ///< overall: kOk, or the first failing block's code
    uint32_t done = 0;                  ///< blocks that succeeded
    std::vector<ErrorCode> blocks;      ///< one per key, in request order
    uint64_t result[5] = {};            ///< lookup: result[0] = longest hit prefix; evict: evicted
    std::vector<uint8_t> payload;       ///< stats: a StatsWire (+ TierStatsWire[count - 1]); ls: LsEntry[count]
  };

  /// Every tier's figures (stats_all): the host pool's, then one entry per lower tier the daemon
  /// runs (disk, remote; none for a host-only daemon or one that predates tier stats).
  struct StoreStats {
    ops::StatsWire host{};
    std::vector<ops::TierStatsWire> tiers;
  };

  /// Connects, performs the handshake and maps the rings. Errors name the socket and the cause
  /// (a refused uid comes back as kPermissionDenied with the daemon's message).
  static Result<std::unique_ptr<Client>> connect(const Options& opts);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  uint32_t id() const { return welcome_.client_id; }
  /// Regions the daemon offered at the handshake (plus those created or mapped since).
  std::vector<proto::RegionDesc> regions() const;
  /// Id of the region named `name` (asks the daemon when the name is not known here yet, e.g. a
  /// region another client created after this one connected).
  Result<uint32_t> find_region(const std::string& name) const;

  /// Where region `region_id` is mapped in this process, or nullptr when it is not (yet).
  void* mapped_base(uint32_t region_id) const;
  /// Maps region `region_id` into this process (once; later calls return the same base).
  Result<void*> map_region(uint32_t region_id);
  /// Asks the daemon to create a region (or reuse one of that name and spec) and maps it.
  Result<uint32_t> create_region(const std::string& name, const KvCacheSpec& spec);
  /// A buffer this process allocated itself (vLLM-style register_kv_caches).
  struct OwnBuffer {
    proto::Backend backend = proto::Backend::kMemfd;
    int fd = -1;                          ///< memfd (sealed F_SEAL_SHRINK) or cuMem POSIX fd; stays ours
    const uint8_t* ipc_handle = nullptr;  ///< 64-byte cudaIpcMemHandle for cuda_ipc
    void* base = nullptr;                 ///< where this process maps the buffer
    uint64_t alloc_bytes = 0;             ///< bytes of the buffer, >= offset + spec.region_bytes()
    int device = -1;                      ///< CUDA device, -1 for host memory
    /// The region starts this far into the buffer (views point at base + offset): a KV tensor
    /// inside a larger allocation, registered without a copy. A multiple of the format's
    /// alignment. Only the registering client maps such a region.
    uint64_t offset = 0;
  };
  /// Registers `buf` as region `name` of `spec`: the daemon imports it and offers it to other
  /// clients; it lives while a client holds it. This process keeps ownership of its buffer.
  Result<uint32_t> register_region(const std::string& name, const KvCacheSpec& spec, const OwnBuffer& buf);
  /// Layer `layer`'s view of a mapped region (MLA/indexer formats; for MHA the K plane).
  Result<LayerView> layer_view(uint32_t region_id, int64_t layer) const;
  /// MHA: layer `layer`'s K (`v_plane` false) or V plane.
  Result<LayerView> kv_view(uint32_t region_id, int64_t layer, bool v_plane) const;

  /// Queues one request; kBusy when the submission ring is full (retry after reaping).
  Status submit(const ring::SubmitEntry& e);
  /// Queues a no-op ping carrying `payload` (echoed in result[0]).
  Status ping(uint64_t id, uint64_t payload);
  /// Takes up to out.size() raw completions without waiting (data ops' completions are filed
  /// for wait_op(), never returned here). Makes no system call: a dead daemon is seen by wait().
  size_t poll(std::span<ring::CompletionEntry> out);
  /// Takes at least one raw completion (up to out.size()), spinning then sleeping; kTimeout
  /// after `timeout_us`, kUnavailable as soon as the daemon is gone.
  Result<size_t> wait(std::span<ring::CompletionEntry> out, int64_t timeout_us);
  /// kOk while the daemon holds the connection; kUnavailable (saying what was lost) once it
  /// closed it. Checks the control socket without blocking.
  Status connection_status();
  /// The per-client shared arena (block lists of the data ops).
  std::span<uint8_t> arena() const { return {ch_.arena, ch_.arena_bytes}; }
  uint32_t ring_entries() const { return welcome_.ring_entries; }

  // ---- data ops (kvferry/connector/ops.h) ----
  // submit_*() queue a request and return its id (the block list goes into a part of the arena
  // the client manages); wait_op() reaps it. At most a ring's worth in flight; kBusy when the
  // ring or the arena is full (reap and retry). Data ops and raw submit() may be mixed, but then
  // the arena belongs to the data ops. Any thread may submit and any thread may wait, for its own
  // op or another's; each op's result is handed out once.
  Result<uint64_t> submit_lookup(uint32_t region_id, std::span<const ops::Key> keys);
  Result<uint64_t> submit_save(uint32_t region_id, std::span<const ops::Key> keys, std::span<const int64_t> block_ids);
  Result<uint64_t> submit_load(uint32_t region_id, std::span<const ops::Key> keys, std::span<const int64_t> block_ids);
  Result<uint64_t> submit_pin(uint32_t region_id, std::span<const ops::Key> keys);
  Result<uint64_t> submit_unpin(uint32_t region_id, std::span<const ops::Key> keys);
  /// `flags`: ops::kEvictAll (the region's whole namespace, keys ignored) or ops::kEvictAllNs
  /// (every namespace; region_id may be 0).
  Result<uint64_t> submit_evict(uint32_t region_id, std::span<const ops::Key> keys, uint64_t flags = 0);
  /// Waits for the data op `id` (kTimeout after `timeout_us`; it can be waited for again).
  /// `timeout_us` 0 checks once without sleeping. kUnavailable when the daemon died first.
  Result<OpResult> wait_op(uint64_t id, int64_t timeout_us);

  static constexpr int64_t kOpTimeoutUs = 60'000'000;
  /// Submit + wait in one call.
  Result<OpResult> lookup(uint32_t region_id, std::span<const ops::Key> keys, int64_t timeout_us = kOpTimeoutUs);
  Result<OpResult> save(uint32_t region_id, std::span<const ops::Key> keys, std::span<const int64_t> block_ids,
                        int64_t timeout_us = kOpTimeoutUs);
  Result<OpResult> load(uint32_t region_id, std::span<const ops::Key> keys, std::span<const int64_t> block_ids,
                        int64_t timeout_us = kOpTimeoutUs);
  Result<OpResult> pin(uint32_t region_id, std::span<const ops::Key> keys, int64_t timeout_us = kOpTimeoutUs);
  Result<OpResult> unpin(uint32_t region_id, std::span<const ops::Key> keys, int64_t timeout_us = kOpTimeoutUs);
  Result<OpResult> evict(uint32_t region_id, std::span<const ops::Key> keys, uint64_t flags = 0,
                         int64_t timeout_us = kOpTimeoutUs);
  /// The daemon's store counters (the host pool's).
  Result<ops::StatsWire> stats(int64_t timeout_us = kOpTimeoutUs);
  /// The host pool's counters and every lower tier's, named by tier (one stats op).
  Result<StoreStats> stats_all(int64_t timeout_us = kOpTimeoutUs);
  /// Stored blocks of region_id's namespace (0 = every namespace), at most `limit` (0 = what fits).
  Result<std::vector<ops::LsEntry>> ls(uint32_t region_id, uint32_t limit = 0, int64_t timeout_us = kOpTimeoutUs);
  /// Remote tier: saves the blocks here, then writes them to the peer daemon `peer` (its member
  /// id, as `kvferry peers` lists it) so that the peer's clients find them (prefill → decode).
  /// Per block: kOk once stored on the peer and verified; the peer's error otherwise.
  /// With `peer_region` (not 0) the blocks also land in that region of the peer, at
  /// `peer_block_ids[i]` (one per key; the decode engine's blocks): kOk then means loaded there.
  Result<uint64_t> submit_send(uint32_t region_id, std::span<const ops::Key> keys, std::span<const int64_t> block_ids,
                               const std::string& peer, uint32_t peer_region = 0,
                               std::span<const int64_t> peer_block_ids = {});
  Result<OpResult> send(uint32_t region_id, std::span<const ops::Key> keys, std::span<const int64_t> block_ids,
                        const std::string& peer, int64_t timeout_us = kOpTimeoutUs);
  Result<OpResult> send_into(uint32_t region_id, std::span<const ops::Key> keys, std::span<const int64_t> block_ids,
                             const std::string& peer, uint32_t peer_region, std::span<const int64_t> peer_block_ids,
                             int64_t timeout_us = kOpTimeoutUs);
  /// Lookup that waits up to `wait_ms` for keys not stored yet (a peer's send landing): each key
  /// completes kOk once stored, kNotFound if still absent then. Without a remote tier it does not wait.
  Result<OpResult> lookup_wait(uint32_t region_id, std::span<const ops::Key> keys, uint32_t wait_ms,
                               int64_t timeout_us = kOpTimeoutUs);
  /// The remote tier's members as JSON text (kvferry peers); kUnavailable without a remote tier.
  Result<std::string> peers(int64_t timeout_us = kOpTimeoutUs);
  /// Load across geometries: entry i puts part `parts[i]` of the stored block `keys[i]` into
  /// region block `block_ids[i]` (ops.h load_mapped; page_map() builds the entries for page sizes).
  /// One status per entry; a region block's entries succeed or fail together.
  Result<uint64_t> submit_load_mapped(uint32_t region_id, std::span<const ops::Key> keys,
                                      std::span<const int64_t> block_ids, std::span<const int32_t> parts);
  Result<OpResult> load_mapped(uint32_t region_id, std::span<const ops::Key> keys, std::span<const int64_t> block_ids,
                               std::span<const int32_t> parts, int64_t timeout_us = kOpTimeoutUs);
  /// The entries of a mapped load of the token sequence that `keys` (stored blocks of
  /// `stored_tokens` each, in order) hold into the region blocks `block_ids` (of `region_tokens`
  /// each, in order): out_keys/out_blocks/out_parts get one entry per (stored block, region block)
  /// pair. kInvalidArgument when the counts do not cover the same tokens or neither page size
  /// divides the other.
  static Status page_map(std::span<const ops::Key> keys, int64_t stored_tokens, std::span<const int64_t> block_ids,
                         int64_t region_tokens, std::vector<ops::Key>* out_keys, std::vector<int64_t>* out_blocks,
                         std::vector<int32_t>* out_parts);
  /// The fault knob (kvferryd --enable-test-faults only): flips byte `byte` of the stored block `key`.
  Result<OpResult> corrupt_for_test(uint32_t region_id, const ops::Key& key, uint64_t byte,
                                    int64_t timeout_us = kOpTimeoutUs);

  /// Reads region bytes through the daemon's own mapping (a debugging and test aid).
  Result<std::vector<uint8_t>> debug_read(uint32_t region_id, uint64_t offset, uint32_t bytes);
  /// The daemon's status (as `kvferry status`).
  Result<proto::StatusReply> status();

 private:
  struct Mapped {
    proto::RegionDesc desc;
    void* base = nullptr;  // where the region starts: the mapping + offset
    uint64_t offset = 0;   // of the region in its buffer
    uint64_t handle = 0;   // cuda vmm
    bool device = false;
    bool owned = true;  // false for a registered buffer: the caller unmaps it
  };
  Client() = default;
  Result<proto::RecvFrame> request(const proto::Frame& f, proto::MsgType want);
  Result<uint32_t> map_handle(proto::RecvFrame& f);
  void unmap(Mapped& m);
  /// Reserves `bytes` of the arena (8-aligned); kBusy when it does not fit now.
  Result<uint32_t> arena_alloc(uint64_t bytes);
  Result<uint64_t> submit_keys(uint16_t op, uint32_t region_id, std::span<const ops::Key> keys,
                               std::span<const int64_t> block_ids, uint64_t arg0, uint64_t extra_bytes,
                               uint64_t arg1 = 0, std::span<const uint8_t> tail = {}, uint64_t arg2 = 0);
  /// Files a completion: a data op's result (reading its arena part, then freeing it) or a raw one.
  /// Called with ops_mu_ held.
  void absorb(const ring::CompletionEntry& c);
  using Clock = std::chrono::steady_clock;
  /// Reaps completions until `done()` holds (checked with ops_mu_ held), `end` passes or the
  /// daemon is gone. One thread reaps at a time; the others sleep on ops_cv_ and are woken for
  /// every batch filed. `lk` holds ops_mu_ on entry and on return.
  Status reap_until(std::unique_lock<std::mutex>& lk, Clock::time_point end, const std::function<bool()>& done);
  /// Takes what the completion ring holds (no waiting) into `out`; returns how many.
  size_t drain_cq(ring::CompletionEntry* out, size_t max);
  /// The daemon closed the control socket (POLLHUP/POLLRDHUP), checked with `timeout_ms`.
  bool socket_closed(int timeout_ms) const;
  /// Records the daemon's death (ops_mu_ held): later waits and submissions fail with it.
  void mark_dead();
  Status dead_status() const;
  struct Pending {
    uint32_t arena_offset = 0;
    uint32_t arena_bytes = 0;
  };

  Options opts_;
  UniqueFd sock_, ring_fd_, sq_efd_, cq_efd_;
  void* ring_base_ = nullptr;
  uint64_t ring_bytes_ = 0;
  ring::Channel ch_;
  proto::Welcome welcome_;
  mutable std::mutex mu_;                                // control channel + maps
  mutable std::map<uint32_t, proto::RegionDesc> known_;  // find_region() learns from the daemon
  std::map<uint32_t, Mapped> mapped_;
  std::mutex sq_mu_;  // the submission ring's single producer
  // data ops and reaping (ops_mu_ guards everything below)
  std::mutex ops_mu_;
  std::condition_variable ops_cv_;           // a reaper filed completions, or gave up its role
  bool reaping_ = false;                     // a thread is taking completions off the ring
  std::atomic<bool> dead_{false};            // the daemon closed the connection
  size_t lost_ops_ = 0;                      // data ops in flight when it did
  uint64_t next_op_id_ = uint64_t{1} << 63;  // data op ids have the top bit set
  std::map<uint32_t, uint32_t> arena_used_;  // offset -> bytes
  std::map<uint64_t, Pending> pending_;
  std::map<uint64_t, OpResult> finished_;
  std::deque<ring::CompletionEntry> raw_;  // raw completions reaped, handed out by poll()/wait()
};

}  // namespace kvferry

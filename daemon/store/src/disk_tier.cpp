#include "kvferry/store/disk_tier.h"

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <future>
#include <list>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "disk_io.h"

namespace kvferry::store {
namespace {

using disk::IoDone;
using disk::IoEngine;
using disk::IoReq;

constexpr char kSlotMagic[8] = {'K', 'V', 'F', 'G', '3', 'S', 'L', 'T'};
constexpr char kSuperMagic[8] = {'K', 'V', 'F', 'G', '3', 'S', 'B', 'K'};
constexpr uint32_t kVersion = 1;
constexpr uint64_t kPage = 4096;
constexpr size_t kMaxNs = 255;
constexpr size_t kMaxFormat = 63;
constexpr int kMaxRetries = 8;
constexpr const char* kFileName = "kvferry-g3.slots";

// Slot header fields (byte offsets); the header's own XXH3 covers [0, kHdrChecksum).
constexpr size_t kHdrVersion = 8, kHdrSlotBytes = 16, kHdrSlotOffset = 24, kHdrGeneration = 32, kHdrBytes = 40,
                 kHdrDataChecksum = 48, kHdrKeyHi = 56, kHdrKeyLo = 64, kHdrNsLen = 72, kHdrFormatLen = 74, kHdrNs = 80,
                 kHdrFormat = kHdrNs + 256, kHdrChecksum = kHdrFormat + 64;
// Superblock fields; the table of extents starts at kPage.
constexpr size_t kSbVersion = 8, kSbExtentBytes = 16, kSbExtents = 24, kSbDataStart = 32, kSbChecksum = 40;

uint64_t round_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

template <class T>
void put(uint8_t* p, size_t off, T v) {
  std::memcpy(p + off, &v, sizeof v);
}
template <class T>
T get(const uint8_t* p, size_t off) {
  T v;
  std::memcpy(&v, p + off, sizeof v);
  return v;
}

Status errno_status(const std::string& what, int err) {
  return {ErrorCode::kIo, what + " failed: " + std::strerror(err) + " (errno " + std::to_string(err) + ")"};
}

/// Owns a file descriptor.
class UniqueFd {
 public:
  explicit UniqueFd(int fd = -1) : fd_(fd) {}
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  void reset(int fd) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_;
};

/// Owns page-aligned memory (O_DIRECT buffers of the tier's own: headers, the extent table).
struct AlignedFree {
  void operator()(uint8_t* p) const { std::free(p); }
};
using AlignedBuf = std::unique_ptr<uint8_t, AlignedFree>;
AlignedBuf aligned_buf(uint64_t bytes) {
  auto* p = static_cast<uint8_t*>(std::aligned_alloc(kPage, round_up(std::max<uint64_t>(bytes, 1), kPage)));
  if (p) std::memset(p, 0, round_up(std::max<uint64_t>(bytes, 1), kPage));
  return AlignedBuf(p);
}

uint64_t table_entry(uint64_t index, uint64_t slot_bytes) {
  const uint64_t pages = slot_bytes / kPage;
  if (pages == 0) return 0;
  const uint64_t mix[2] = {index, pages};
  return pages << 32 | (block_checksum(mix, sizeof mix) & 0xffffffffu);
}
/// Slot bytes of a table entry; 0 for unassigned, ~0 for a damaged entry.
uint64_t table_slot_bytes(uint64_t index, uint64_t entry) {
  if (entry == 0) return 0;
  const uint64_t bytes = (entry >> 32) * kPage;
  return table_entry(index, bytes) == entry ? bytes : ~uint64_t{0};
}

void encode_header(uint8_t* h, const BlockRecord& r, uint64_t slot_bytes, uint64_t slot_offset) {
  std::memset(h, 0, kPage);
  std::memcpy(h, kSlotMagic, sizeof kSlotMagic);
  put<uint32_t>(h, kHdrVersion, kVersion);
  put<uint32_t>(h, kHdrVersion + 4, static_cast<uint32_t>(DiskTier::kHeaderBytes));
  put<uint64_t>(h, kHdrSlotBytes, slot_bytes);
  put<uint64_t>(h, kHdrSlotOffset, slot_offset);
  put<uint64_t>(h, kHdrGeneration, r.generation);
  put<uint64_t>(h, kHdrBytes, r.bytes);
  put<uint64_t>(h, kHdrDataChecksum, r.checksum);
  put<uint64_t>(h, kHdrKeyHi, r.key.hi);
  put<uint64_t>(h, kHdrKeyLo, r.key.lo);
  put<uint16_t>(h, kHdrNsLen, static_cast<uint16_t>(r.ns.size()));
  put<uint16_t>(h, kHdrFormatLen, static_cast<uint16_t>(r.format.size()));
  std::memcpy(h + kHdrNs, r.ns.data(), r.ns.size());
  std::memcpy(h + kHdrFormat, r.format.data(), r.format.size());
  put<uint64_t>(h, kHdrChecksum, block_checksum(h, kHdrChecksum));
}

enum class HeaderVerdict { kValid, kEmpty, kDamaged, kStale };

HeaderVerdict decode_header(const uint8_t* h, uint64_t slot_bytes, uint64_t slot_offset, BlockRecord* r,
                            std::string* why) {
  if (std::memcmp(h, kSlotMagic, sizeof kSlotMagic) != 0) {
    // A never-written slot reads as zeros; anything else where a header belongs is damage.
    for (size_t i = 0; i < kHdrChecksum + 8; ++i)
      if (h[i] != 0) {
        *why = "bad magic";
        return HeaderVerdict::kDamaged;
      }
    return HeaderVerdict::kEmpty;
  }
  if (get<uint64_t>(h, kHdrChecksum) != block_checksum(h, kHdrChecksum)) {
    *why = "header checksum mismatch";
    return HeaderVerdict::kDamaged;
  }
  if (get<uint32_t>(h, kHdrVersion) != kVersion) {
    *why = "version " + std::to_string(get<uint32_t>(h, kHdrVersion));
    return HeaderVerdict::kDamaged;
  }
  // A header of an earlier slot class left behind in an extent that was reassigned.
  if (get<uint64_t>(h, kHdrSlotBytes) != slot_bytes || get<uint64_t>(h, kHdrSlotOffset) != slot_offset)
    return HeaderVerdict::kStale;
  const auto ns_len = get<uint16_t>(h, kHdrNsLen);
  const auto fmt_len = get<uint16_t>(h, kHdrFormatLen);
  r->bytes = get<uint64_t>(h, kHdrBytes);
  if (ns_len > kMaxNs || fmt_len > kMaxFormat || r->bytes == 0 || DiskTier::slot_bytes_for(r->bytes) != slot_bytes) {
    *why = "inconsistent sizes";
    return HeaderVerdict::kDamaged;
  }
  r->ns.assign(reinterpret_cast<const char*>(h + kHdrNs), ns_len);
  r->format.assign(reinterpret_cast<const char*>(h + kHdrFormat), fmt_len);
  r->generation = get<uint64_t>(h, kHdrGeneration);
  r->checksum = get<uint64_t>(h, kHdrDataChecksum);
  r->key.hi = get<uint64_t>(h, kHdrKeyHi);
  r->key.lo = get<uint64_t>(h, kHdrKeyLo);
  return HeaderVerdict::kValid;
}

std::string slot_name(const std::string& path, uint64_t offset) {
  return path + " slot at offset " + std::to_string(offset);
}

}  // namespace

Result<Durability> parse_durability(std::string_view s) {
  if (s == "none") return Durability::kNone;
  if (s == "batch") return Durability::kBatch;
  if (s == "each") return Durability::kEach;
  return Result<Durability>(ErrorCode::kConfig,
                            "durability must be none, batch or each (got '" + std::string(s) + "')");
}

// ---------------------------------------------------------------------------------------------
// The index and the I/O threads.

struct DiskTier::Impl {
  struct Extent {
    uint64_t slot_bytes = 0;  ///< 0: unassigned
    uint32_t nslots = 0;
    uint32_t used = 0;
    std::vector<uint32_t> free_slots;  ///< popped from the back: low slots first
  };
  enum class State : uint8_t { kWriting, kReady };
  struct Entry {
    State state = State::kWriting;
    std::string format;
    uint64_t bytes = 0;
    uint64_t checksum = 0;
    uint64_t generation = 0;
    uint32_t extent = 0;
    uint32_t slot = 0;
    uint32_t readers = 0;
    uint32_t pins = 0;
    /// Its place in the LRU list, taken when the write is submitted, so "oldest" means written
    /// first whatever order the writes of a batch finish in.
    std::list<NsKey>::iterator lru;
  };

  struct Batch;
  struct Job;
  /// One system call's worth of a job (data or header), or a batch's / block's fdatasync.
  struct SubOp {
    Job* job = nullptr;
    Batch* batch = nullptr;  ///< set for a batch's fdatasync (job == nullptr)
    IoReq::Kind kind = IoReq::kRead;
    uint8_t* buf = nullptr;
    uint64_t len = 0;
    uint64_t offset = 0;
    int retries = 0;
  };
  struct Job {
    Batch* batch = nullptr;
    TierOp op = TierOp::kRead;
    uint64_t cookie = 0;
    NsKey key;
    BlockRecord record;  ///< reads: the stored record; writes: the record being stored
    uint8_t* buf = nullptr;
    uint64_t io_len = 0;
    uint64_t slot_offset = 0;  ///< header offset; data follows at + kHeaderBytes
    uint64_t slot_bytes = 0;
    int header = -1;  ///< index into the worker's header arena
    int pending = 0;
    Status status;
    SubOp ops[2];
  };
  struct Batch {
    std::vector<std::unique_ptr<Job>> jobs;
    size_t open = 0;            ///< jobs not yet completed
    size_t writes_left = 0;     ///< writes whose data/header I/O has not settled
    std::vector<Job*> written;  ///< writes waiting for the batch's fdatasync
    SubOp fsync;
  };

  struct Worker {
    Impl* tier = nullptr;
    std::unique_ptr<IoEngine> engine;
    AlignedBuf headers;  ///< queue_depth headers of 4 KiB
    std::vector<int> free_headers;
    struct Range {
      uintptr_t begin, end;
      int index;
    };
    std::vector<Range> fixed;  ///< registered buffers, sorted by begin

    std::mutex mu;  ///< guards inbox, tasks, stop, verified
    std::deque<std::unique_ptr<Batch>> inbox;
    std::deque<std::function<void()>> tasks;
    bool stop = false;
    std::vector<Job*> verified;  ///< reads whose completion a verifier handed out, to retire here

    // Owned by the thread.
    std::list<std::unique_ptr<Batch>> active;
    std::deque<Job*> pending;
    std::deque<SubOp*> retry;
    std::vector<Job*> to_verify;  ///< reads whose bytes are in, for the verifiers
    unsigned verifying = 0;       ///< reads with the verifiers, not yet retired
    unsigned inflight = 0;
    std::thread thread;

    int buf_index(const uint8_t* p, uint64_t len) const {
      const auto b = reinterpret_cast<uintptr_t>(p);
      auto it =
          std::upper_bound(fixed.begin(), fixed.end(), b, [](uintptr_t v, const Range& r) { return v < r.begin; });
      if (it == fixed.begin()) return -1;
      --it;
      return b + len <= it->end ? it->index : -1;
    }
  };

  Options opts;
  std::string path;
  UniqueFd fd{-1};
  bool direct = true;
  uint64_t n_extents = 0;
  uint64_t data_start = 0;
  AlignedBuf table;  ///< superblock page + extent table, as on disk
  uint64_t table_bytes = 0;
  std::string engine_name;

  mutable std::mutex mu;  ///< the index: extents, map, lru, namespaces, health
  std::vector<Extent> extents;
  std::unordered_map<NsKey, Entry, NsKeyHash> map;
  std::list<NsKey> lru;  ///< front = most recently used; entries being written included
  std::unordered_map<std::string, NamespaceId> ns_ids;
  std::vector<std::string> ns_names;
  std::vector<BlockRecord> victims;
  uint64_t next_generation = 1;
  uint64_t used_bytes = 0;
  uint64_t pinned = 0;
  bool submitted = false;
  bool stopping = false;
  bool degraded = false;
  std::string degraded_reason;
  std::atomic<uint64_t> io_errors{0}, checksum_failures{0}, short_retries{0}, evictions{0}, bytes_written{0},
      bytes_read{0};

  std::mutex done_mu;
  std::condition_variable done_cv;
  std::deque<TierCompletion> done;

  std::vector<std::unique_ptr<Worker>> workers;
  std::atomic<size_t> next_worker{0};

  /// Reads waiting for their XXH3 check, and the threads that check them (started after the I/O
  /// threads, stopped after them: a worker leaves only once its reads are all back).
  std::mutex verify_mu;
  std::condition_variable verify_cv;
  std::deque<std::pair<Worker*, Job*>> verify_queue;
  bool verify_stop = false;
  std::vector<std::thread> verifiers;

  void log(const std::string& line) const {
    if (opts.log)
      opts.log(line);
    else
      std::fprintf(stderr, "kvferry disk tier: %s\n", line.c_str());
  }

  // ---- index (callers hold mu) ----
  NamespaceId intern(std::string_view ns) {
    auto it = ns_ids.find(std::string(ns));
    if (it != ns_ids.end()) return it->second;
    const auto id = static_cast<NamespaceId>(ns_names.size());
    ns_names.emplace_back(ns);
    ns_ids.emplace(std::string(ns), id);
    return id;
  }
  std::optional<NsKey> find_key(std::string_view ns, const BlockKey& key) const {
    auto it = ns_ids.find(std::string(ns));
    if (it == ns_ids.end()) return std::nullopt;
    return NsKey{it->second, key};
  }
  uint64_t slot_offset(uint32_t extent, uint32_t slot) const {
    return data_start + extent * opts.extent_bytes + uint64_t{slot} * extents[extent].slot_bytes;
  }
  BlockRecord record_of(const NsKey& k, const Entry& e) const {
    return {ns_names[k.ns], k.key, e.format, e.bytes, e.checksum, e.generation};
  }
  bool evictable(const Entry& e) const { return e.state == State::kReady && e.readers == 0 && e.pins == 0; }

  Status assign_extent(uint32_t x, uint64_t slot_bytes) {
    Extent& e = extents[x];
    e.slot_bytes = slot_bytes;
    e.nslots = static_cast<uint32_t>(opts.extent_bytes / slot_bytes);
    e.used = 0;
    e.free_slots.resize(e.nslots);
    for (uint32_t i = 0; i < e.nslots; ++i) e.free_slots[i] = e.nslots - 1 - i;
    // The table entry is durable before any slot of the extent is, so recovery reads the slots of
    // the right class.
    put<uint64_t>(table.get(), kPage + x * 8, table_entry(x, slot_bytes));
    const uint64_t page = (kPage + x * 8) / kPage * kPage;
    if (::pwrite(fd.get(), table.get() + page, kPage, static_cast<off_t>(page)) != static_cast<ssize_t>(kPage))
      return errno_status("writing the extent table of " + path, errno);
    if (::fdatasync(fd.get()) != 0) return errno_status("fdatasync of " + path, errno);
    return Status::Ok();
  }

  /// A free slot of `slot_bytes`: in an extent of that class, else a fresh extent, else an empty
  /// extent of another class.
  std::optional<std::pair<uint32_t, uint32_t>> alloc_slot(uint64_t slot_bytes, Status* err) {
    for (uint32_t x = 0; x < extents.size(); ++x) {
      Extent& e = extents[x];
      if (e.slot_bytes == slot_bytes && !e.free_slots.empty()) {
        const uint32_t s = e.free_slots.back();
        e.free_slots.pop_back();
        ++e.used;
        return std::pair{x, s};
      }
    }
    auto take = [&](uint32_t x) -> std::optional<std::pair<uint32_t, uint32_t>> {
      if (Status s = assign_extent(x, slot_bytes); !s.ok()) {
        *err = s;
        return std::nullopt;
      }
      Extent& e = extents[x];
      const uint32_t s = e.free_slots.back();
      e.free_slots.pop_back();
      ++e.used;
      return std::pair{x, s};
    };
    for (uint32_t x = 0; x < extents.size(); ++x)
      if (extents[x].slot_bytes == 0) return take(x);
    for (uint32_t x = 0; x < extents.size(); ++x)
      if (extents[x].used == 0) return take(x);
    return std::nullopt;
  }

  void free_slot(uint32_t x, uint32_t s) {
    Extent& e = extents[x];
    e.free_slots.push_back(s);
    --e.used;
  }

  void erase_locked(std::unordered_map<NsKey, Entry, NsKeyHash>::iterator it) {
    Entry& e = it->second;
    lru.erase(e.lru);
    used_bytes -= extents[e.extent].slot_bytes;
    free_slot(e.extent, e.slot);
    map.erase(it);
  }

  void evict_one_locked(std::unordered_map<NsKey, Entry, NsKeyHash>::iterator it, std::vector<BlockRecord>* out) {
    out->push_back(record_of(it->first, it->second));
    evictions.fetch_add(1, std::memory_order_relaxed);
    erase_locked(it);
  }

  /// Evicts the oldest idle blocks until a slot of `slot_bytes` can be had: one of its class if
  /// there is one, else until some extent is empty. Returns how many went.
  size_t make_room_locked(uint64_t slot_bytes) {
    size_t n = 0;
    for (auto it = lru.rbegin(); it != lru.rend();) {
      auto m = map.find(*it);
      ++it;
      if (evictable(m->second) && extents[m->second.extent].slot_bytes == slot_bytes) {
        evict_one_locked(m, &victims);
        return 1;
      }
    }
    // Oldest first; `it` stays one past the element looked at, so erasing that one keeps it valid.
    for (auto it = lru.end(); it != lru.begin();) {
      auto m = map.find(*std::prev(it));
      if (!evictable(m->second)) {
        --it;
        continue;
      }
      const uint32_t x = m->second.extent;
      evict_one_locked(m, &victims);
      ++n;
      if (extents[x].used == 0) break;
    }
    return n;
  }

  void set_degraded(const std::string& why) {
    std::lock_guard lk(mu);
    if (!degraded) log("degraded: " + why);
    degraded = true;
    degraded_reason = why;
  }

  Status io_error(const Job* j, const char* what, int err) {
    io_errors.fetch_add(1, std::memory_order_relaxed);
    std::string where = slot_name(path, j ? j->slot_offset : 0);
    if (err == ENOSPC)
      return {ErrorCode::kResourceExhausted,
              std::string(what) + " of " + where +
                  ": no space left on the device (ENOSPC; thin or copy-on-write storage?)"};
    Status s = errno_status(std::string(what) + " of " + where, err);
    if (err == EIO) set_degraded(s.message());
    return s;
  }

  void post(TierCompletion c) {
    {
      std::lock_guard lk(done_mu);
      done.push_back(std::move(c));
    }
    done_cv.notify_all();
  }

  // ---- completion of jobs ----
  /// Settles the index for a finished job and hands its completion out. Any of the tier's threads.
  void publish(Job* j) {
    TierCompletion c{j->cookie, j->op, j->status, {}};
    {
      std::lock_guard lk(mu);
      auto it = map.find(j->key);
      if (j->op == TierOp::kWrite) {
        if (it != map.end()) {
          if (j->status.ok()) {
            it->second.state = State::kReady;
          } else {
            erase_locked(it);
          }
        }
      } else if (it != map.end()) {
        --it->second.readers;
        const ErrorCode code = j->status.code();
        if ((code == ErrorCode::kChecksumMismatch || code == ErrorCode::kDataLoss) && it->second.readers == 0)
          erase_locked(it);  // damaged: never served again
      }
    }
    if (j->status.ok()) (j->op == TierOp::kWrite ? bytes_written : bytes_read).fetch_add(j->record.bytes);
    c.record = std::move(j->record);
    post(std::move(c));
  }

  /// Drops a published job from its batch (freeing the batch with its last job). The worker's thread.
  void retire(Worker& w, Job* j) {
    Batch* b = j->batch;
    if (--b->open == 0) {
      w.active.remove_if([b](const std::unique_ptr<Batch>& p) { return p.get() == b; });
    }
  }

  void complete(Worker& w, Job* j) {
    publish(j);
    retire(w, j);
  }

  void settle_write(Worker& w, Batch* b) {
    if (--b->writes_left != 0 || b->written.empty()) return;
    b->fsync = SubOp{nullptr, b, IoReq::kFsync};
    issue(w, &b->fsync);
  }

  void job_io_done(Worker& w, Job* j) {
    if (--j->pending > 0) return;
    if (j->header >= 0) {
      w.free_headers.push_back(j->header);
      j->header = -1;
    }
    if (j->op == TierOp::kRead) {
      if (j->status.ok())
        w.to_verify.push_back(j);  // hashed off this thread, which goes back to reaping and refilling
      else
        complete(w, j);
      return;
    }
    if (!j->status.ok() || opts.durability == Durability::kNone) {
      if (opts.durability == Durability::kBatch) {
        Batch* b = j->batch;
        complete(w, j);  // may not free b: settle_write's decrement keeps it referenced below
        settle_write_after(w, b);
      } else {
        complete(w, j);
      }
      return;
    }
    if (opts.durability == Durability::kEach) {
      j->pending = 1;
      j->ops[0] = SubOp{j, nullptr, IoReq::kFsync};
      issue(w, &j->ops[0]);
      return;
    }
    j->batch->written.push_back(j);
    settle_write(w, j->batch);
  }

  // A failed write of a batch: its slot is gone; the batch's fdatasync may now be due.
  void settle_write_after(Worker& w, Batch* b) {
    // complete() removes the batch when its last job finished; then nothing is left to settle.
    for (auto& p : w.active)
      if (p.get() == b) {
        settle_write(w, b);
        return;
      }
  }

  void subop_done(Worker& w, SubOp* op, int64_t res) {
    if (op->kind == IoReq::kFsync) {
      std::vector<Job*> jobs;
      if (op->job)
        jobs.push_back(op->job);
      else
        jobs.swap(op->batch->written);
      Status st;
      if (res < 0) st = io_error(jobs.empty() ? nullptr : jobs.front(), "fdatasync", static_cast<int>(-res));
      for (Job* j : jobs) {  // the last complete() may free the batch, and with it `op`
        if (!st.ok()) j->status = st;
        complete(w, j);
      }
      return;
    }
    Job* j = op->job;
    if (res < 0) {
      const int err = static_cast<int>(-res);
      if ((err == EAGAIN || err == EINTR) && op->retries < kMaxRetries) {
        ++op->retries;
        w.retry.push_back(op);
        return;
      }
      if (j->status.ok()) j->status = io_error(j, op->kind == IoReq::kRead ? "read" : "write", err);
      job_io_done(w, j);
      return;
    }
    const auto got = static_cast<uint64_t>(res);
    if (got < op->len) {
      if (got == 0 || op->retries >= kMaxRetries) {
        if (j->status.ok()) {
          const std::string what = std::string(op->kind == IoReq::kRead ? "short read" : "short write") + " of " +
                                   slot_name(path, j->slot_offset) + ": " + std::to_string(got) + " of " +
                                   std::to_string(op->len) + " bytes after " + std::to_string(op->retries) + " retries";
          j->status = {op->kind == IoReq::kRead ? ErrorCode::kDataLoss : ErrorCode::kIo, what};
          io_errors.fetch_add(1, std::memory_order_relaxed);
        }
        job_io_done(w, j);
        return;
      }
      short_retries.fetch_add(1, std::memory_order_relaxed);
      op->buf += got;
      op->offset += got;
      op->len -= got;
      ++op->retries;
      w.retry.push_back(op);
      return;
    }
    job_io_done(w, j);
  }

  void issue(Worker& w, SubOp* op) {
    IoReq r{op->kind, op->buf, op->len, op->offset, -1, reinterpret_cast<uint64_t>(op)};
    if (op->kind != IoReq::kFsync) r.buf_index = w.buf_index(op->buf, op->len);
    w.engine->push(r);
    ++w.inflight;
  }

  void start_job(Worker& w, Job* j) {
    const uint64_t data_off = j->slot_offset + kHeaderBytes;
    if (j->op == TierOp::kRead) {
      j->pending = 1;
      j->ops[0] = SubOp{j, nullptr, IoReq::kRead, j->buf, j->io_len, data_off};
      issue(w, &j->ops[0]);
      return;
    }
    j->header = w.free_headers.back();
    w.free_headers.pop_back();
    uint8_t* h = w.headers.get() + static_cast<uint64_t>(j->header) * kPage;
    encode_header(h, j->record, j->slot_bytes, j->slot_offset);
    j->pending = 2;
    j->ops[0] = SubOp{j, nullptr, IoReq::kWrite, j->buf, j->io_len, data_off};
    j->ops[1] = SubOp{j, nullptr, IoReq::kWrite, h, kPage, j->slot_offset};
    issue(w, &j->ops[0]);
    issue(w, &j->ops[1]);
  }

  /// Hands the reads that came in on this turn to the verifiers (one lock, one wake-up per turn).
  void send_to_verifiers(Worker& w) {
    if (w.to_verify.empty()) return;
    const size_t n = w.to_verify.size();
    {
      std::lock_guard lk(verify_mu);
      for (Job* j : w.to_verify) verify_queue.emplace_back(&w, j);
    }
    w.verifying += static_cast<unsigned>(n);
    w.to_verify.clear();
    if (n == 1)
      verify_cv.notify_one();
    else
      verify_cv.notify_all();
  }

  /// A verifier: checks a read block's bytes against its XXH3 and hands out its completion (a
  /// mismatch is dropped from the index and logged, never served); the worker retires the job.
  void run_verifier() {
    std::unique_lock lk(verify_mu);
    for (;;) {
      verify_cv.wait(lk, [&] { return verify_stop || !verify_queue.empty(); });
      if (verify_queue.empty()) return;
      auto [w, j] = verify_queue.front();
      verify_queue.pop_front();
      lk.unlock();
      if (block_checksum(j->buf, j->record.bytes) != j->record.checksum) {
        checksum_failures.fetch_add(1, std::memory_order_relaxed);
        j->status = {ErrorCode::kChecksumMismatch, "block " + j->record.key.hex() + " of '" + j->record.ns + "' in " +
                                                       slot_name(path, j->slot_offset) +
                                                       " no longer matches its XXH3: dropped"};
        log(j->status.message());
      }
      publish(j);
      {
        std::lock_guard wl(w->mu);
        w->verified.push_back(j);
      }
      lk.lock();
    }
  }

  void cancel_job(Worker& w, Job* j) {
    j->status = {ErrorCode::kCancelled, "the disk tier is shutting down"};
    const bool batch_write = j->op == TierOp::kWrite && opts.durability == Durability::kBatch;
    Batch* b = j->batch;
    complete(w, j);
    if (batch_write) settle_write_after(w, b);
  }

  void run_worker(Worker& w) {
    std::vector<IoDone> done_io;
    std::vector<Job*> verified;
    const unsigned depth = std::max(1u, opts.queue_depth);
    for (;;) {
      bool stop;
      std::deque<std::function<void()>> tasks;
      verified.clear();
      {
        std::lock_guard lk(w.mu);
        stop = w.stop;
        tasks.swap(w.tasks);
        verified.swap(w.verified);
        while (!w.inbox.empty()) {
          auto b = std::move(w.inbox.front());
          w.inbox.pop_front();
          for (auto& j : b->jobs) w.pending.push_back(j.get());
          w.active.push_back(std::move(b));
        }
      }
      for (auto& t : tasks) t();
      w.verifying -= static_cast<unsigned>(verified.size());
      for (Job* j : verified) retire(w, j);
      if (stop) {
        while (!w.pending.empty()) {
          Job* j = w.pending.front();
          w.pending.pop_front();
          cancel_job(w, j);
        }
      }
      while (!w.retry.empty() && w.inflight < depth + 2) {
        SubOp* op = w.retry.front();
        w.retry.pop_front();
        issue(w, op);
      }
      while (!w.pending.empty() && w.inflight < depth) {
        Job* j = w.pending.front();
        if (j->op == TierOp::kWrite && w.free_headers.empty()) break;
        w.pending.pop_front();
        start_job(w, j);
      }
      if (stop && w.inflight == 0 && w.retry.empty() && w.pending.empty() && w.verifying == 0) break;
      done_io.clear();
      // Stopping, the last reads' retirement is polled for: verifiers do not wake this thread.
      if (Status s = w.engine->run(done_io, stop && w.verifying > 0 ? 1 : 100); !s.ok()) {
        set_degraded(s.message());
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      for (const IoDone& d : done_io) {
        --w.inflight;
        subop_done(w, reinterpret_cast<SubOp*>(d.tag), d.res);
      }
      send_to_verifiers(w);
    }
  }

  Status on_worker(Worker& w, std::function<Status()> fn) {
    auto task = std::make_shared<std::packaged_task<Status()>>(std::move(fn));
    auto fut = task->get_future();
    {
      std::lock_guard lk(w.mu);
      w.tasks.emplace_back([task] { (*task)(); });
    }
    w.engine->wake();
    return fut.get();
  }

  Status register_on(Worker& w, std::span<const iovec> caller) {
    std::vector<iovec> all;
    all.push_back({w.headers.get(), static_cast<size_t>(std::max(1u, opts.queue_depth)) * kPage});
    all.insert(all.end(), caller.begin(), caller.end());
    Status s = w.engine->register_buffers(all);
    w.fixed.clear();
    if (s.ok())
      for (size_t i = 0; i < all.size(); ++i) {
        const auto b = reinterpret_cast<uintptr_t>(all[i].iov_base);
        w.fixed.push_back({b, b + all[i].iov_len, static_cast<int>(i)});
      }
    std::sort(w.fixed.begin(), w.fixed.end(), [](const auto& a, const auto& b) { return a.begin < b.begin; });
    return s;
  }

  Result<std::unique_ptr<IoEngine>> make_engine(unsigned depth, bool quiet) {
    if (!opts.force_fallback) {
      auto e = disk::make_uring_engine(fd.get(), depth);
      if (e.ok()) return std::move(e).value();
      if (!quiet)
        log("io_uring refused (" + e.status().to_string() + "): using a pool of " +
            std::to_string(opts.fallback_threads) + " pread/pwrite threads for " + path);
    }
    return disk::make_posix_engine(fd.get(), std::max(1u, opts.fallback_threads));
  }

  // ---- open ----
  Status open_file() {
    struct stat st {};
    bool block_device = false;
    path = opts.path;
    if (::stat(path.c_str(), &st) == 0) {
      if (S_ISDIR(st.st_mode)) path += (path.ends_with('/') ? "" : "/") + std::string(kFileName);
      block_device = S_ISBLK(st.st_mode);
    }
    direct = opts.direct_io;
    const int flags = O_RDWR | O_CLOEXEC | (block_device ? 0 : O_CREAT) | (direct ? O_DIRECT : 0);
    const int f = ::open(path.c_str(), flags, 0600);
    if (f < 0) {
      const int err = errno;
      std::string what = "opening the disk tier's slot file " + path + (direct ? " with O_DIRECT" : "");
      Status s = errno_status(what, err);
      if (err == EINVAL && direct)
        s = {s.code(), s.message() + "; this file system may not support O_DIRECT (set direct_io: false)"};
      return s;
    }
    fd.reset(f);
    uint64_t capacity = opts.capacity;
    if (block_device) {
      uint64_t dev_bytes = 0;
      if (::ioctl(f, BLKGETSIZE64, &dev_bytes) != 0) return errno_status("BLKGETSIZE64 on " + path, errno);
      capacity = std::min(capacity, dev_bytes);
    }
    const uint64_t max_extents = capacity / opts.extent_bytes;
    table_bytes = round_up(kPage + max_extents * 8, kPage);
    data_start = table_bytes;
    n_extents = capacity > data_start ? (capacity - data_start) / opts.extent_bytes : 0;
    if (n_extents == 0)
      return {ErrorCode::kConfig, "disk tier " + path + ": capacity " + std::to_string(capacity) +
                                      " bytes holds no extent of " + std::to_string(opts.extent_bytes) + " bytes"};
    const uint64_t file_bytes = data_start + n_extents * opts.extent_bytes;
    if (!block_device) {
      if (::fstat(f, &st) != 0) return errno_status("fstat of " + path, errno);
      if (const int rc = ::posix_fallocate(f, 0, static_cast<off_t>(file_bytes)); rc != 0)
        return errno_status("preallocating " + std::to_string(file_bytes) + " bytes for " + path + " (fallocate)", rc);
      if (static_cast<uint64_t>(st.st_size) > file_bytes && ::ftruncate(f, static_cast<off_t>(file_bytes)) != 0)
        return errno_status("truncating " + path, errno);
    }
    extents.assign(n_extents, Extent{});
    table = aligned_buf(table_bytes);
    if (!table) return {ErrorCode::kResourceExhausted, "no memory for the extent table"};
    return load_or_format();
  }

  Status load_or_format() {
    uint8_t* t = table.get();
    const ssize_t n = ::pread(fd.get(), t, table_bytes, 0);
    if (n < 0) return errno_status("reading the superblock of " + path, errno);
    bool valid = n >= static_cast<ssize_t>(kPage) && std::memcmp(t, kSuperMagic, 8) == 0 &&
                 get<uint64_t>(t, kSbChecksum) == block_checksum(t, kSbChecksum) &&
                 get<uint32_t>(t, kSbVersion) == kVersion && get<uint64_t>(t, kSbExtentBytes) == opts.extent_bytes &&
                 get<uint64_t>(t, kSbDataStart) == data_start;
    if (!valid) {
      if (n >= 8 && std::memcmp(t, kSuperMagic, 8) == 0)
        log(path + " holds a slot file of another geometry or version: formatting it anew (its blocks are dropped)");
      std::memset(t, 0, table_bytes);
    } else {
      const uint64_t old_n = std::min<uint64_t>(get<uint64_t>(t, kSbExtents), (table_bytes - kPage) / 8);
      size_t damaged = 0;
      for (uint64_t x = 0; x < n_extents; ++x) {
        const uint64_t e = x < old_n ? get<uint64_t>(t, kPage + x * 8) : 0;
        const uint64_t sb = table_slot_bytes(x, e);
        if (sb == ~uint64_t{0} || sb > opts.extent_bytes || (sb != 0 && sb < 2 * kPage)) {
          ++damaged;
          put<uint64_t>(t, kPage + x * 8, 0);
          continue;
        }
        put<uint64_t>(t, kPage + x * 8, e);
        if (sb != 0) {
          Extent& ex = extents[x];
          ex.slot_bytes = sb;
          ex.nslots = static_cast<uint32_t>(opts.extent_bytes / sb);
          ex.free_slots.resize(ex.nslots);
          for (uint32_t i = 0; i < ex.nslots; ++i) ex.free_slots[i] = ex.nslots - 1 - i;
        }
      }
      if (damaged)
        log(std::to_string(damaged) + " damaged extent table entries in " + path + ": their extents dropped");
      for (uint64_t x = n_extents; x < (table_bytes - kPage) / 8; ++x) put<uint64_t>(t, kPage + x * 8, 0);
      if (old_n == n_extents && damaged == 0) return Status::Ok();
    }
    std::memcpy(t, kSuperMagic, 8);
    put<uint32_t>(t, kSbVersion, kVersion);
    put<uint64_t>(t, kSbExtentBytes, opts.extent_bytes);
    put<uint64_t>(t, kSbExtents, n_extents);
    put<uint64_t>(t, kSbDataStart, data_start);
    put<uint64_t>(t, kSbChecksum, block_checksum(t, kSbChecksum));
    if (::pwrite(fd.get(), t, table_bytes, 0) != static_cast<ssize_t>(table_bytes))
      return errno_status("writing the superblock of " + path, errno);
    if (::fdatasync(fd.get()) != 0) return errno_status("fdatasync of " + path, errno);
    return Status::Ok();
  }
};

// ---------------------------------------------------------------------------------------------

DiskTier::DiskTier(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<DiskTier>> DiskTier::open(Options opts) {
  using R = Result<std::unique_ptr<DiskTier>>;
  if (opts.path.empty()) return R(ErrorCode::kConfig, "disk tier: no path");
  if (opts.extent_bytes < 2 * kPage || opts.extent_bytes % kPage != 0)
    return R(ErrorCode::kConfig, "disk tier: extent_bytes must be a multiple of 4096 of at least 8192");
  if (opts.queue_depth == 0 || opts.io_threads == 0)
    return R(ErrorCode::kConfig, "disk tier: queue_depth and io_threads must be at least 1");
  auto impl = std::make_unique<Impl>();
  impl->opts = std::move(opts);
  KVFERRY_TRY(impl->open_file());
  Impl& t = *impl;
  const unsigned depth = t.opts.queue_depth;
  for (unsigned i = 0; i < t.opts.io_threads; ++i) {
    auto w = std::make_unique<Impl::Worker>();
    w->tier = &t;
    KVFERRY_ASSIGN_OR_RETURN(w->engine, t.make_engine(depth + 2, i > 0));
    w->headers = aligned_buf(uint64_t{depth} * kPage);
    if (!w->headers) return R(ErrorCode::kResourceExhausted, "no memory for the disk tier's headers");
    for (int h = static_cast<int>(depth) - 1; h >= 0; --h) w->free_headers.push_back(h);
    if (Status s = t.register_on(*w, {}); !s.ok() && i == 0)
      t.log("registering the header buffers failed (" + s.to_string() + "): plain reads and writes");
    t.workers.push_back(std::move(w));
  }
  t.engine_name = std::string(t.workers.front()->engine->name());
  if (t.opts.force_fallback) t.log("using the pread/pwrite pool for " + t.path + " (force_fallback)");
  unsigned verify_threads = t.opts.verify_threads;
  if (verify_threads == 0) verify_threads = std::clamp(std::thread::hardware_concurrency() / 4, 1u, 4u);
  for (unsigned i = 0; i < verify_threads; ++i) t.verifiers.emplace_back([&t] { t.run_verifier(); });
  for (auto& w : t.workers) w->thread = std::thread([&t, wp = w.get()] { t.run_worker(*wp); });
  return std::unique_ptr<DiskTier>(new DiskTier(std::move(impl)));
}

DiskTier::~DiskTier() {
  {
    std::lock_guard lk(impl_->mu);
    impl_->stopping = true;
  }
  for (auto& w : impl_->workers) {
    {
      std::lock_guard lk(w->mu);
      w->stop = true;
    }
    w->engine->wake();
  }
  for (auto& w : impl_->workers) w->thread.join();
  {
    std::lock_guard lk(impl_->verify_mu);
    impl_->verify_stop = true;
  }
  impl_->verify_cv.notify_all();
  for (auto& v : impl_->verifiers) v.join();
}

std::string_view DiskTier::engine() const { return impl_->engine_name; }
const std::string& DiskTier::file_path() const { return impl_->path; }

Status DiskTier::register_buffers(std::span<const iovec> buffers) {
  Status first;
  for (auto& w : impl_->workers) {
    Status s = impl_->on_worker(*w, [&] { return impl_->register_on(*w, buffers); });
    if (!s.ok() && first.ok()) first = s;
  }
  return first;
}

Status DiskTier::submit(std::span<const TierRequest> batch) {
  Impl& t = *impl_;
  if (batch.empty()) return Status::Ok();
  auto b = std::make_unique<Impl::Batch>();
  std::vector<TierCompletion> now;
  {
    std::lock_guard lk(t.mu);
    if (t.stopping) return {ErrorCode::kCancelled, "the disk tier is shutting down"};
    t.submitted = true;
    for (const TierRequest& r : batch) {
      auto fail = [&](ErrorCode c, std::string m) {
        BlockRecord rec = r.record;
        now.push_back({r.cookie, r.op, Status(c, std::move(m)), std::move(rec)});
      };
      const uint64_t io_len = t.direct ? round_up(r.record.bytes, kPage) : r.record.bytes;
      if (r.op == TierOp::kWrite && (r.record.bytes == 0 || r.buf == nullptr || r.buf_bytes < io_len)) {
        fail(ErrorCode::kInvalidArgument, "block " + r.record.key.hex() + ": a write needs a buffer of " +
                                              std::to_string(io_len) + " bytes (has " + std::to_string(r.buf_bytes) +
                                              ") and a non-zero size");
        continue;
      }
      if (t.direct && reinterpret_cast<uintptr_t>(r.buf) % kPage != 0) {
        fail(ErrorCode::kMisaligned, "block " + r.record.key.hex() + ": O_DIRECT needs a 4 KiB aligned buffer");
        continue;
      }
      auto job = std::make_unique<Impl::Job>();
      job->op = r.op;
      job->cookie = r.cookie;
      job->buf = r.buf;
      if (r.op == TierOp::kRead) {
        auto k = t.find_key(r.record.ns, r.record.key);
        auto it = k ? t.map.find(*k) : t.map.end();
        if (it == t.map.end() || it->second.state != Impl::State::kReady) {
          fail(ErrorCode::kNotFound, "block " + r.record.key.hex() + " is not on disk");
          continue;
        }
        Impl::Entry& e = it->second;
        const uint64_t need = t.direct ? round_up(e.bytes, kPage) : e.bytes;
        if (r.buf == nullptr || r.buf_bytes < need) {
          fail(ErrorCode::kInvalidArgument, "block " + r.record.key.hex() + " needs a buffer of " +
                                                std::to_string(need) + " bytes (has " + std::to_string(r.buf_bytes) +
                                                ")");
          continue;
        }
        ++e.readers;
        t.lru.splice(t.lru.begin(), t.lru, e.lru);
        job->key = *k;
        job->record = t.record_of(*k, e);
        job->io_len = need;
        job->slot_bytes = t.extents[e.extent].slot_bytes;
        job->slot_offset = t.slot_offset(e.extent, e.slot);
      } else {
        if (r.record.ns.size() > kMaxNs || r.record.format.size() > kMaxFormat) {
          fail(ErrorCode::kInvalidArgument, "namespace (<= 255 bytes) or format name (<= 63 bytes) too long");
          continue;
        }
        const uint64_t slot_bytes = slot_bytes_for(r.record.bytes);
        if (slot_bytes > t.opts.extent_bytes) {
          fail(ErrorCode::kInvalidArgument, "a block of " + std::to_string(r.record.bytes) +
                                                " bytes does not fit a disk extent of " +
                                                std::to_string(t.opts.extent_bytes) + " bytes");
          continue;
        }
        const NsKey k{t.intern(r.record.ns), r.record.key};
        if (auto it = t.map.find(k); it != t.map.end()) {
          if (it->second.state == Impl::State::kReady) {
            t.lru.splice(t.lru.begin(), t.lru, it->second.lru);
            now.push_back({r.cookie, r.op, Status::Ok(), t.record_of(k, it->second)});
          } else {
            fail(ErrorCode::kAlreadyExists, "block " + r.record.key.hex() + " is being written");
          }
          continue;
        }
        Status err;
        auto slot = t.alloc_slot(slot_bytes, &err);
        size_t evicted = 0;
        if (!slot && err.ok()) {  // full: evict the oldest idle blocks and retry once
          evicted = t.make_room_locked(slot_bytes);
          if (evicted > 0) slot = t.alloc_slot(slot_bytes, &err);
        }
        if (!slot) {
          if (!err.ok()) {
            fail(err.code(), err.message());
          } else {
            fail(ErrorCode::kResourceExhausted, "disk tier " + t.path + " is full: no slot of " +
                                                    std::to_string(slot_bytes) + " bytes for block " +
                                                    r.record.key.hex() + " after evicting " + std::to_string(evicted) +
                                                    " blocks (the rest are pinned or in flight)");
          }
          continue;
        }
        Impl::Entry e;
        e.format = r.record.format;
        e.bytes = r.record.bytes;
        e.checksum = r.record.checksum;
        e.generation = t.next_generation++;
        e.extent = slot->first;
        e.slot = slot->second;
        t.used_bytes += slot_bytes;
        job->key = k;
        job->record = t.record_of(k, e);
        job->io_len = io_len;
        job->slot_bytes = slot_bytes;
        job->slot_offset = t.slot_offset(e.extent, e.slot);
        t.lru.push_front(k);
        e.lru = t.lru.begin();
        t.map.emplace(k, std::move(e));
        ++b->writes_left;
      }
      job->batch = b.get();
      b->jobs.push_back(std::move(job));
    }
    b->open = b->jobs.size();
  }
  if (!now.empty()) {
    {
      std::lock_guard lk(t.done_mu);
      for (auto& c : now) t.done.push_back(std::move(c));
    }
    t.done_cv.notify_all();
  }
  if (b->jobs.empty()) return Status::Ok();
  auto& w = *t.workers[t.next_worker.fetch_add(1, std::memory_order_relaxed) % t.workers.size()];
  {
    std::lock_guard lk(w.mu);
    w.inbox.push_back(std::move(b));
  }
  w.engine->wake();
  return Status::Ok();
}

size_t DiskTier::poll(std::vector<TierCompletion>& out, size_t max, std::chrono::milliseconds wait) {
  Impl& t = *impl_;
  std::unique_lock lk(t.done_mu);
  if (t.done.empty() && wait.count() > 0) t.done_cv.wait_for(lk, wait, [&] { return !t.done.empty(); });
  size_t n = 0;
  while (n < max && !t.done.empty()) {
    out.push_back(std::move(t.done.front()));
    t.done.pop_front();
    ++n;
  }
  return n;
}

std::optional<BlockRecord> DiskTier::lookup(std::string_view ns, const BlockKey& key) {
  Impl& t = *impl_;
  std::lock_guard lk(t.mu);
  auto k = t.find_key(ns, key);
  if (!k) return std::nullopt;
  auto it = t.map.find(*k);
  if (it == t.map.end() || it->second.state != Impl::State::kReady) return std::nullopt;
  t.lru.splice(t.lru.begin(), t.lru, it->second.lru);
  return t.record_of(*k, it->second);
}

Status DiskTier::erase(std::string_view ns, const BlockKey& key) {
  Impl& t = *impl_;
  std::lock_guard lk(t.mu);
  auto k = t.find_key(ns, key);
  auto it = k ? t.map.find(*k) : t.map.end();
  if (it == t.map.end()) return {ErrorCode::kNotFound, "block " + key.hex() + " is not on disk"};
  if (!t.evictable(it->second)) return {ErrorCode::kBusy, "block " + key.hex() + " is pinned, read or written"};
  t.erase_locked(it);
  return Status::Ok();
}

std::vector<BlockRecord> DiskTier::list(std::optional<std::string_view> ns, size_t limit) const {
  const Impl& t = *impl_;
  std::lock_guard lk(t.mu);
  std::vector<BlockRecord> out;
  for (const NsKey& k : t.lru) {
    if (out.size() >= limit) break;
    if (ns && t.ns_names[k.ns] != *ns) continue;
    const auto& e = t.map.at(k);
    if (e.state == Impl::State::kReady) out.push_back(t.record_of(k, e));
  }
  return out;
}

Status DiskTier::pin(std::string_view ns, const BlockKey& key) {
  Impl& t = *impl_;
  std::lock_guard lk(t.mu);
  auto k = t.find_key(ns, key);
  auto it = k ? t.map.find(*k) : t.map.end();
  if (it == t.map.end() || it->second.state != Impl::State::kReady)
    return {ErrorCode::kNotFound, "block " + key.hex() + " is not on disk"};
  if (it->second.pins++ == 0) ++t.pinned;
  return Status::Ok();
}

Status DiskTier::unpin(std::string_view ns, const BlockKey& key) {
  Impl& t = *impl_;
  std::lock_guard lk(t.mu);
  auto k = t.find_key(ns, key);
  auto it = k ? t.map.find(*k) : t.map.end();
  if (it == t.map.end() || it->second.pins == 0)
    return {ErrorCode::kNotFound, "block " + key.hex() + " is not pinned on disk"};
  if (--it->second.pins == 0) --t.pinned;
  return Status::Ok();
}

std::vector<BlockRecord> DiskTier::evict(uint64_t bytes) {
  Impl& t = *impl_;
  std::lock_guard lk(t.mu);
  std::vector<BlockRecord> out;
  uint64_t freed = 0;
  for (auto it = t.lru.end(); it != t.lru.begin() && freed < bytes;) {  // oldest first, as make_room_locked
    auto m = t.map.find(*std::prev(it));
    if (!t.evictable(m->second)) {
      --it;
      continue;
    }
    freed += t.extents[m->second.extent].slot_bytes;
    t.evict_one_locked(m, &out);
  }
  return out;
}

std::vector<BlockRecord> DiskTier::take_victims() {
  std::lock_guard lk(impl_->mu);
  return std::exchange(impl_->victims, {});
}

TierUsage DiskTier::usage() const {
  const Impl& t = *impl_;
  std::lock_guard lk(t.mu);
  return {t.n_extents * t.opts.extent_bytes, t.used_bytes, t.map.size(), t.pinned};
}

TierHealth DiskTier::health() const {
  const Impl& t = *impl_;
  TierHealth h;
  {
    std::lock_guard lk(t.mu);
    h.ok = !t.degraded;
    h.reason = t.degraded_reason;
  }
  h.io_errors = t.io_errors.load();
  h.checksum_failures = t.checksum_failures.load();
  h.short_io_retries = t.short_retries.load();
  h.evictions = t.evictions.load();
  h.bytes_written = t.bytes_written.load();
  h.bytes_read = t.bytes_read.load();
  return h;
}

std::optional<std::pair<uint64_t, uint64_t>> DiskTier::slot_of(std::string_view ns, const BlockKey& key) const {
  const Impl& t = *impl_;
  std::lock_guard lk(t.mu);
  auto k = t.find_key(ns, key);
  auto it = k ? t.map.find(*k) : t.map.end();
  if (it == t.map.end()) return std::nullopt;
  return std::pair{t.slot_offset(it->second.extent, it->second.slot), t.extents[it->second.extent].slot_bytes};
}

Result<uint64_t> DiskTier::recover() {
  Impl& t = *impl_;
  {
    std::lock_guard lk(t.mu);
    if (t.submitted || !t.map.empty())
      return Result<uint64_t>(ErrorCode::kBusy, "recover() runs at start, before the first submit");
  }
  const auto t0 = std::chrono::steady_clock::now();
  struct Slot {
    uint32_t extent, slot;
  };
  std::vector<Slot> slots;
  for (uint32_t x = 0; x < t.extents.size(); ++x)
    for (uint32_t s = 0; s < t.extents[x].nslots; ++s) slots.push_back({x, s});

  const unsigned depth = std::max(64u, 2 * t.opts.queue_depth);
  KVFERRY_ASSIGN_OR_RETURN(auto engine, t.make_engine(depth, true));
  AlignedBuf arena = aligned_buf(uint64_t{depth} * kPage);
  if (!arena) return Result<uint64_t>(ErrorCode::kResourceExhausted, "no memory to read slot headers");
  const iovec iov{arena.get(), size_t{depth} * kPage};
  const bool fixed = engine->register_buffers({&iov, 1}).ok();

  struct Found {
    BlockRecord rec;
    Slot where;
  };
  std::vector<Found> found;
  size_t damaged = 0, stale = 0, unreadable = 0, logged = 0;
  std::vector<uint32_t> free_bufs(depth);
  for (uint32_t i = 0; i < depth; ++i) free_bufs[i] = depth - 1 - i;
  std::vector<size_t> buf_slot(depth);
  std::vector<int> retries(depth, 0);
  size_t next = 0, inflight = 0;
  std::vector<IoDone> done_io;
  auto push = [&](uint32_t b, size_t idx) {
    buf_slot[b] = idx;
    const Slot& s = slots[idx];
    engine->push(
        {IoReq::kRead, arena.get() + uint64_t{b} * kPage, kPage, t.slot_offset(s.extent, s.slot), fixed ? 0 : -1, b});
    ++inflight;
  };
  const auto deadline = t0 + std::chrono::minutes(10);
  while (next < slots.size() || inflight > 0) {
    while (next < slots.size() && !free_bufs.empty()) {
      const uint32_t b = free_bufs.back();
      free_bufs.pop_back();
      retries[b] = 0;
      push(b, next++);
    }
    done_io.clear();
    KVFERRY_TRY(engine->run(done_io, 100));
    if (std::chrono::steady_clock::now() > deadline)
      return Result<uint64_t>(ErrorCode::kTimeout, "reading the slot headers of " + t.path + " took over 10 minutes");
    for (const IoDone& d : done_io) {
      --inflight;
      const auto b = static_cast<uint32_t>(d.tag);
      const Slot& s = slots[buf_slot[b]];
      const uint64_t off = t.slot_offset(s.extent, s.slot);
      if (d.res != static_cast<int64_t>(kPage)) {
        if ((d.res == -EAGAIN || d.res == -EINTR || (d.res > 0)) && retries[b]++ < kMaxRetries) {
          push(b, buf_slot[b]);  // short or interrupted header read: read it again whole
          continue;
        }
        ++unreadable;
        if (logged++ < 32) t.log("unreadable header of " + slot_name(t.path, off) + ": dropped");
        free_bufs.push_back(b);
        continue;
      }
      Found f;
      std::string why;
      switch (decode_header(arena.get() + uint64_t{b} * kPage, t.extents[s.extent].slot_bytes, off, &f.rec, &why)) {
        case HeaderVerdict::kValid:
          f.where = s;
          found.push_back(std::move(f));
          break;
        case HeaderVerdict::kEmpty: break;
        case HeaderVerdict::kStale: ++stale; break;
        case HeaderVerdict::kDamaged:
          ++damaged;
          if (logged++ < 32) t.log("damaged header of " + slot_name(t.path, off) + " (" + why + "): dropped");
          break;
      }
      free_bufs.push_back(b);
    }
  }
  // Oldest first, so the LRU list ends newest-first and a key written twice keeps its newest copy.
  std::sort(found.begin(), found.end(),
            [](const Found& a, const Found& b) { return a.rec.generation < b.rec.generation; });
  uint64_t n = 0;
  {
    std::lock_guard lk(t.mu);
    for (Found& f : found) {
      const NsKey k{t.intern(f.rec.ns), f.rec.key};
      if (auto it = t.map.find(k); it != t.map.end()) {  // an older copy of the same block
        t.lru.erase(it->second.lru);
        t.used_bytes -= t.extents[it->second.extent].slot_bytes;
        t.map.erase(it);
      }
      Impl::Entry e;
      e.state = Impl::State::kReady;
      e.format = std::move(f.rec.format);
      e.bytes = f.rec.bytes;
      e.checksum = f.rec.checksum;
      e.generation = f.rec.generation;
      e.extent = f.where.extent;
      e.slot = f.where.slot;
      t.used_bytes += t.extents[e.extent].slot_bytes;
      t.lru.push_front(k);
      e.lru = t.lru.begin();
      t.map.emplace(k, std::move(e));
      t.next_generation = std::max(t.next_generation, f.rec.generation + 1);
    }
    // Free lists from what is held (lowest slots handed out first).
    std::vector<std::vector<uint8_t>> held(t.extents.size());
    for (size_t x = 0; x < t.extents.size(); ++x) held[x].assign(t.extents[x].nslots, 0);
    for (const auto& [k, e] : t.map) held[e.extent][e.slot] = 1;
    for (size_t x = 0; x < t.extents.size(); ++x) {
      Impl::Extent& ex = t.extents[x];
      ex.free_slots.clear();
      ex.used = 0;
      for (uint32_t i = ex.nslots; i-- > 0;) {
        if (held[x][i])
          ++ex.used;
        else
          ex.free_slots.push_back(i);
      }
    }
    n = t.map.size();
  }
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  char line[256];
  std::snprintf(line, sizeof line,
                "recovered %llu blocks from %zu slots of %s in %.0f ms (%zu damaged, %zu unreadable, "
                "%zu stale dropped)",
                static_cast<unsigned long long>(n), slots.size(), t.path.c_str(), ms, damaged, unreadable, stale);
  t.log(line);
  return n;
}

}  // namespace kvferry::store

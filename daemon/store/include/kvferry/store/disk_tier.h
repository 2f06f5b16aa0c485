#pragma once
// DiskTier: G3, blocks in one preallocated slot file (or a block device) per tier, moved with
// io_uring (a pread/pwrite thread pool where io_uring is refused or not built).
//
// On-disk layout (little-endian): a superblock (4 KiB) and an extent table (one 8-byte entry per
// extent), then `extent_bytes` extents. An extent, once assigned, holds fixed slots of one size
// class: a 4 KiB self-describing header (magic, version, namespace, key, format, bytes, XXH3 of
// the data, generation, the slot's own offset, and the header's own XXH3) followed by the data
// rounded up to 4 KiB. A block is visible only once its data and header are durable (policy
// `durability`); recover() rebuilds the index by reading the headers alone. A damaged header is
// dropped at recovery and damaged data at read (its XXH3 is checked on every read): never served.
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "kvferry/store/tier.h"

namespace kvferry::store {

enum class Durability : uint8_t {
  kNone,   ///< visible once written; a crash may lose recent blocks (never serves damaged ones)
  kBatch,  ///< one fdatasync per submitted batch before its completions are handed out
  kEach,   ///< one fdatasync per block
};

class DiskTier final : public Tier {
 public:
  struct Options {
    /// A directory (the tier uses `<path>/kvferry-g3.slots`), a file, or a block device.
    std::string path;
    uint64_t capacity = uint64_t{64} << 30;  ///< bytes of the slot file (a block device: at most its size)
    /// Slots of one size class are carved from extents of this size; a block plus its 4 KiB
    /// header must fit in one extent.
    uint64_t extent_bytes = uint64_t{256} << 20;
    unsigned queue_depth = 32;  ///< I/Os in flight per I/O thread (>= 1)
    unsigned io_threads = 1;    ///< one ring (or pool) per thread; a batch stays on one thread
    Durability durability = Durability::kBatch;
    bool direct_io = true;          ///< O_DIRECT; false for file systems without it (tmpfs-like)
    bool force_fallback = false;    ///< use the pread/pwrite pool even where io_uring works
    unsigned fallback_threads = 4;  ///< threads of the pread/pwrite pool, per I/O thread
    /// Threads (shared by the I/O threads) that check each read block's XXH3 and hand out its
    /// completion, so an I/O thread only reaps and refills its ring. 0: a quarter of the cores,
    /// 1 to 4.
    unsigned verify_threads = 0;
    /// Log sink for the few lines the tier writes (fallback chosen, damaged slot dropped, device
    /// error). Default: stderr. Called from the tier's threads; never per block on the hot path
    /// except for damaged blocks.
    std::function<void(std::string_view line)> log;
  };

  /// Opens (creating and preallocating when needed) the slot file and starts the I/O threads.
  /// Refuses, naming the path and the errno, when the file cannot be opened (with O_DIRECT unless
  /// `direct_io` is false) or preallocated. Does not read existing slots: call recover().
  static Result<std::unique_ptr<DiskTier>> open(Options opts);
  /// Waits for I/O in flight; requests not yet started complete with kCancelled (poll them
  /// before destroying, or they are dropped).
  ~DiskTier() override;
  DiskTier(const DiskTier&) = delete;
  DiskTier& operator=(const DiskTier&) = delete;

  std::string_view name() const override { return "disk"; }
  Result<uint64_t> recover() override;
  Status register_buffers(std::span<const iovec> buffers) override;
  Status submit(std::span<const TierRequest> batch) override;
  size_t poll(std::vector<TierCompletion>& out, size_t max, std::chrono::milliseconds wait) override;
  std::optional<BlockRecord> lookup(std::string_view ns, const BlockKey& key) override;
  Status erase(std::string_view ns, const BlockKey& key) override;
  std::vector<BlockRecord> list(std::optional<std::string_view> ns, size_t limit) const override;
  Status pin(std::string_view ns, const BlockKey& key) override;
  Status unpin(std::string_view ns, const BlockKey& key) override;
  std::vector<BlockRecord> evict(uint64_t bytes) override;
  std::vector<BlockRecord> take_victims() override;
  TierUsage usage() const override;
  TierHealth health() const override;

  /// "io_uring" or "pread/pwrite": the engine the I/O threads use.
  std::string_view engine() const;
  /// The slot file's path (the directory's `kvferry-g3.slots` when a directory was given).
  const std::string& file_path() const;
  /// Where a held block lives in the file: {header offset, slot bytes}; for tests and tools.
  std::optional<std::pair<uint64_t, uint64_t>> slot_of(std::string_view ns, const BlockKey& key) const;

  /// Slot size of a block of `bytes`: its 4 KiB header plus the bytes rounded up to 4 KiB.
  static uint64_t slot_bytes_for(uint64_t bytes) { return kHeaderBytes + (bytes + 4095) / 4096 * 4096; }
  static constexpr uint64_t kHeaderBytes = 4096;

  struct Impl;

 private:
  explicit DiskTier(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// "none" | "batch" | "each" (the config's spelling).
Result<Durability> parse_durability(std::string_view s);

}  // namespace kvferry::store

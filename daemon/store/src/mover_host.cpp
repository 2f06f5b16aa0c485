// The host mover: memcpy between a host region and the pool, a block at a time on the thread
// that asks (one thread per block: the offload service runs blocks in parallel on its pool, each
// beside its checksum).
#include <vector>

#include "kvferry/kernels/convert.h"
#include "kvferry/kernels/copy_blocks.h"
#include "mover.h"

namespace kvferry::store {
namespace {

class HostOp final : public MoveOp {
 public:
  HostOp(const RegionAccess& region, bool to_pool, PoolAccess pool) : region_(region), to_pool_(to_pool), pool_(pool) {}

  int depth() const override { return 0; }
  Status enqueue(size_t, std::span<const CopyRun>) override { return Status::Ok(); }
  Status wait(size_t) override { return Status::Ok(); }

  Status move_block(std::span<const CopyRun> runs) override {
    const int64_t rb = region_.spec.region_bytes();
    return to_pool_ ? kernels::copy_blocks_cpu(region_.base, rb, pool_.base, pool_.bytes, runs, {1})
                    : kernels::copy_blocks_cpu(pool_.base, pool_.bytes, region_.base, rb, runs, {1});
  }

  Status convert_block(const uint8_t* stored, const BlockShape& shape, std::span<const CopyRun> runs,
                       std::vector<int64_t>* lossy) override {
    if (to_pool_) return {ErrorCode::kInternal, "convert_block on a save"};
    // Through a one-block staging copy: a conversion that turns out lossy must leave the target
    // block as it was.
    const KvCacheSpec one = BlockShape{region_.spec.layers, region_.spec.block_size, region_.spec.format}.slot_spec();
    std::vector<uint8_t> staged(static_cast<size_t>(one.region_bytes()));
    const int64_t zero = 0;
    KVFERRY_TRY(kernels::convert_blocks_cpu(stored, shape.slot_spec(), {&zero, 1}, staged.data(), one, {&zero, 1},
                                            {pool_.cpu_threads}, lossy));
    if (!lossy->empty()) return Status::Ok();  // the caller reports data loss
    return kernels::copy_blocks_cpu(staged.data(), one.region_bytes(), region_.base, region_.spec.region_bytes(), runs,
                                    {1});
  }

  Status place_block(const uint8_t* buf, int64_t bytes, std::span<const CopyRun> runs) override {
    if (to_pool_) return {ErrorCode::kInternal, "place_block on a save"};
    return kernels::copy_blocks_cpu(buf, bytes, region_.base, region_.spec.region_bytes(), runs, {1});
  }

  Status finish() override { return Status::Ok(); }

 private:
  RegionAccess region_;
  bool to_pool_;
  PoolAccess pool_;
};

class HostMover final : public Mover {
 public:
  explicit HostMover(PoolAccess pool) : pool_(pool) {}
  Status prepare() override { return Status::Ok(); }
  Result<std::unique_ptr<MoveOp>> begin(const RegionAccess& region, bool to_pool) override {
    return std::unique_ptr<MoveOp>(std::make_unique<HostOp>(region, to_pool, pool_));
  }

 private:
  PoolAccess pool_;
};

}  // namespace

std::unique_ptr<Mover> make_host_mover(PoolAccess pool) { return std::make_unique<HostMover>(pool); }

}  // namespace kvferry::store

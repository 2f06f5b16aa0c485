// Built instead of mover_cuda.cpp when kvferry is configured without CUDA: the offload service
// then refuses use_cuda, and every block of a device region fails with this reason.
#include "mover.h"

namespace kvferry::store {

Result<std::unique_ptr<Mover>> make_cuda_mover(PoolAccess) {
  return Result<std::unique_ptr<Mover>>(ErrorCode::kUnavailable, "kvferry was built without CUDA");
}

}  // namespace kvferry::store

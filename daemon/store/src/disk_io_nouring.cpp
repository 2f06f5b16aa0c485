// Built instead of disk_io_uring.cpp when kvferry is configured without liburing: the disk tier
// then always runs on the pread/pwrite pool.
#include "disk_io.h"

namespace kvferry::store::disk {

Result<std::unique_ptr<IoEngine>> make_uring_engine(int, unsigned) {
  return Result<std::unique_ptr<IoEngine>>(ErrorCode::kUnavailable, "kvferry was built without liburing");
}

}  // namespace kvferry::store::disk

#pragma once
// The I/O engines under DiskTier (private to the store): io_uring, or a pread/pwrite thread pool
// where io_uring is refused or not built. An engine moves single requests and hands back raw
// results (bytes or -errno); retries, short I/O and errors are the tier's business, so both
// engines run under the same state machine. One engine belongs to one I/O thread.
#include <sys/uio.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "kvferry/layouts/status.h"

namespace kvferry::store::disk {

struct IoReq {
  enum Kind : uint8_t { kRead, kWrite, kFsync };
  Kind kind = kRead;
  uint8_t* buf = nullptr;
  uint64_t len = 0;
  uint64_t offset = 0;
  int buf_index = -1;  ///< registered buffer holding [buf, buf+len), or -1
  uint64_t tag = 0;    ///< handed back in IoDone
};

struct IoDone {
  uint64_t tag = 0;
  int64_t res = 0;  ///< bytes moved, 0 for a finished fsync, or -errno
};

class IoEngine {
 public:
  virtual ~IoEngine() = default;
  virtual std::string_view name() const = 0;
  /// Queues one request; the caller keeps at most the engine's depth in flight.
  virtual void push(const IoReq& r) = 0;
  /// Submits what push() queued, then waits up to `timeout_ms` (0: not at all) for a completion or
  /// a wake(), and appends every completion that is there. Called by the owning thread only.
  virtual Status run(std::vector<IoDone>& out, int timeout_ms) = 0;
  /// Ends a run() that is waiting. Any thread.
  virtual void wake() = 0;
  /// Registers buffers (replacing an earlier set); index i of `bufs` becomes buf_index i.
  virtual Status register_buffers(std::span<const iovec> bufs) = 0;
};

/// An io_uring engine for `fd` with `depth` requests in flight; kUnavailable when io_uring is not
/// built, or the kernel's error when the ring cannot be set up (seccomp, old kernel, limits).
Result<std::unique_ptr<IoEngine>> make_uring_engine(int fd, unsigned depth);
/// A pool of `threads` threads doing pread/pwrite/fdatasync on `fd`.
std::unique_ptr<IoEngine> make_posix_engine(int fd, unsigned threads);

}  // namespace kvferry::store::disk

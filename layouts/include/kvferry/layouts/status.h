#pragma once
// The one error vocabulary of kvferry: ErrorCode (fixed values, they cross the wire), Status,
// Result<T> and KVFERRY_TRY. Host code only.
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace kvferry {

/// Error codes. The numeric values are part of the wire protocol: never renumber, only append.
enum class ErrorCode : int16_t {
  kOk = 0,
  kInvalidArgument = 1,    ///< a parameter is malformed or inconsistent
  kOutOfRange = 2,         ///< an index (block, layer, slot) is past its bound
  kOverflow = 3,           ///< a size or offset does not fit in int64
  kMisaligned = 4,         ///< an address, offset or stride violates an alignment rule
  kNotFound = 5,           ///< a key, region or client is unknown
  kAlreadyExists = 6,      ///< a unique name or key is taken
  kResourceExhausted = 7,  ///< a pool, ring or disk is full
  kUnavailable = 8,        ///< a capability was not built or has no device (e.g. no CUDA GPU)
  kInternal = 9,           ///< a broken invariant inside kvferry
  kUnsupported = 10,       ///< a valid request kvferry does not implement (e.g. a format pair)
  kProtocol = 11,          ///< a malformed message on the wire
  kVersionMismatch = 12,   ///< peer speaks another protocol version
  kPermissionDenied = 13,  ///< a peer's credentials are not allowed
  kChecksumMismatch = 14,  ///< stored bytes no longer match their checksum
  kTimeout = 15,           ///< a deadline passed
  kCancelled = 16,         ///< the work was cancelled (client gone, shutdown)
  kIo = 17,                ///< an operating-system call failed (errno in the message)
  kCuda = 18,              ///< a CUDA call failed
  kUcx = 19,               ///< a UCX call failed
  kConfig = 20,            ///< a configuration value is invalid
  kBusy = 21,              ///< try again later (backpressure)
  kDataLoss = 22,          ///< a stored block is gone or unreadable
};

/// Stable name of a code, e.g. "out_of_range".
constexpr std::string_view error_code_name(ErrorCode c) {
  switch (c) {
    case ErrorCode::kOk: return "ok";
    case ErrorCode::kInvalidArgument: return "invalid_argument";
    case ErrorCode::kOutOfRange: return "out_of_range";
    case ErrorCode::kOverflow: return "overflow";
    case ErrorCode::kMisaligned: return "misaligned";
    case ErrorCode::kNotFound: return "not_found";
    case ErrorCode::kAlreadyExists: return "already_exists";
    case ErrorCode::kResourceExhausted: return "resource_exhausted";
    case ErrorCode::kUnavailable: return "unavailable";
    case ErrorCode::kInternal: return "internal";
    case ErrorCode::kUnsupported: return "unsupported";
    case ErrorCode::kProtocol: return "protocol";
    case ErrorCode::kVersionMismatch: return "version_mismatch";
    case ErrorCode::kPermissionDenied: return "permission_denied";
    case ErrorCode::kChecksumMismatch: return "checksum_mismatch";
    case ErrorCode::kTimeout: return "timeout";
    case ErrorCode::kCancelled: return "cancelled";
    case ErrorCode::kIo: return "io";
    case ErrorCode::kCuda: return "cuda";
    case ErrorCode::kUcx: return "ucx";
    case ErrorCode::kConfig: return "config";
    case ErrorCode::kBusy: return "busy";
    case ErrorCode::kDataLoss: return "data_loss";
  }
  return "unknown";
}

/// Success, or an error code with a message that names the culprit. Cheap when ok.
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(ErrorCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return {}; }

  bool ok() const { return code_ == ErrorCode::kOk; }
  explicit operator bool() const { return ok(); }
  ErrorCode code() const { return code_; }
  const std::string& message() const { return message_; }

  /// "out_of_range: block 17 is past the region's 16 blocks"
  std::string to_string() const {
    if (ok()) return "ok";
    std::string s(error_code_name(code_));
    s += ": ";
    s += message_;
    return s;
  }

  /// Prepends context: "loading region 'r0': <message>".
  Status with_context(std::string_view ctx) const {
    if (ok()) return *this;
    std::string m(ctx);
    m += ": ";
    m += message_;
    return {code_, std::move(m)};
  }

 private:
  ErrorCode code_ = ErrorCode::kOk;
  std::string message_;
};

/// A value or an error Status.
template <class T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}        // NOLINT(google-explicit-constructor)
  Result(Status status) : v_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    if (std::get<Status>(v_).ok()) v_ = Status(ErrorCode::kInternal, "Result built from an ok Status");
  }
  Result(ErrorCode code, std::string message) : v_(Status(code, std::move(message))) {}

  bool ok() const { return std::holds_alternative<T>(v_); }
  explicit operator bool() const { return ok(); }
  Status status() const { return ok() ? Status() : std::get<Status>(v_); }

  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<T, Status> v_;
};

namespace detail {
inline Status to_status(Status s) { return s; }
template <class T>
Status to_status(const Result<T>& r) {
  return r.status();
}
}  // namespace detail

}  // namespace kvferry

/// Returns the Status of `expr` (a Status or a Result) from the enclosing function on error.
#define KVFERRY_TRY(expr)                                                         \
  do {                                                                            \
    ::kvferry::Status kvferry_try_status_ = ::kvferry::detail::to_status((expr)); \
    if (!kvferry_try_status_.ok()) return kvferry_try_status_;                    \
  } while (0)

#define KVFERRY_CONCAT_INNER_(a, b) a##b
#define KVFERRY_CONCAT_(a, b) KVFERRY_CONCAT_INNER_(a, b)
/// `KVFERRY_ASSIGN_OR_RETURN(auto x, make_x());` binds the value or returns the error (`lhs` may
/// declare, so it takes no parentheses).
#define KVFERRY_ASSIGN_OR_RETURN(lhs, expr)                                                                   \
  auto KVFERRY_CONCAT_(kvferry_res_, __LINE__) = (expr);                                                      \
  if (!KVFERRY_CONCAT_(kvferry_res_, __LINE__).ok()) return KVFERRY_CONCAT_(kvferry_res_, __LINE__).status(); \
  lhs = std::move(KVFERRY_CONCAT_(kvferry_res_, __LINE__)).value()  // NOLINT(bugprone-macro-parentheses)

// libFuzzer target for the control-channel frame decoder: splits the input into frames and
// decodes every payload. Any crash, sanitizer report or broken invariant is a failure.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>

#include "kvferry/connector/protocol.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const uint8_t> rest(data, size);
  while (!rest.empty()) {
    auto r = kvferry::proto::decode_frame(rest);
    if (!r.ok() || r->second == 0) break;
    if (r->second > rest.size()) std::abort();  // a frame can never claim more than it was given
    (void)kvferry::proto::validate_payload(r->first.header, r->first.payload);
    rest = rest.subspan(r->second);
  }
  return 0;
}

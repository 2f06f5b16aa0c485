#pragma once
// Region-to-region sends to peer daemons on this host (tiers.remote.local_transfer; DESIGN.md §4,
// G4 "GPUs of one host"). A prefill engine's send into a decode engine's region, when the decode
// engine's daemon runs on the same host, skips both host pools: this daemon imports the peer's
// region once (a one-time token over the cluster's authenticated channel, then a session on the
// peer's control socket that maps it: the cuMem fd or IPC handle of a GPU region, the memfd of a
// host region) and copies the blocks straight from the sender's region into it (copy-engine DMA,
// device to device over NVLink or within one GPU; memcpy for host regions), then tells the peer
// which blocks landed. Nothing is stored on either side; the bytes never leave the GPUs.
//
// Regions of different formats, block sizes or layer counts need a conversion, which the daemon
// does not run on a shared GPU (DESIGN.md §4): such sends go through the host pools as before
// (send() returns nullopt), as do sends to a peer on another host or one that does not export.
// Thread-safe: sends from several data workers share the imports; each send uses its own copier.
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvferry/daemon/region.h"
#include "kvferry/layouts/status.h"
#include "kvferry/store/block_key.h"

namespace kvferry::store {
class RemoteStore;
}

namespace kvferry::daemon {

class LocalSender {
 public:
  using Clock = std::chrono::steady_clock;

  /// `name`: how this daemon introduces itself to the peers' control sockets.
  LocalSender(store::RemoteStore& remote, std::string name);
  ~LocalSender();
  LocalSender(const LocalSender&) = delete;
  LocalSender& operator=(const LocalSender&) = delete;

  /// Copies blocks `ids` of `src` into blocks `peer_ids` of region `peer_region` of member `peer`
  /// (namespace `ns_name`, whose tenant must reach that region) and tells the peer: one status per
  /// block (kOk once the peer has them in its region). nullopt when the peer cannot be reached
  /// region to region (another host, not exporting, a region that needs a conversion): the caller
  /// goes through the host pools.
  std::optional<std::vector<Status>> send(const Region& src, const std::string& ns_name, const std::string& peer,
                                          uint32_t peer_region, std::span<const store::BlockKey> keys,
                                          std::span<const int64_t> ids, std::span<const int64_t> peer_ids,
                                          Clock::time_point deadline);

  /// Blocks sent region to region (for the metrics).
  uint64_t blocks_sent() const;

  struct Import;

 private:
  Result<std::shared_ptr<Import>> import(const std::string& peer, const std::string& ns_name, uint32_t region,
                                         Clock::time_point deadline, bool* fall_back);
  void forget(const std::string& peer, const std::string& ns_name, uint32_t region);

  store::RemoteStore& remote_;
  std::string name_;
  struct Lanes;  // a stream and a copier per device, kept from send to send (local_send.cpp)
  std::unique_ptr<Lanes> lanes_;
  mutable std::mutex mu_;
  std::map<std::tuple<std::string, std::string, uint32_t>, std::shared_ptr<Import>> imports_;
  std::map<std::string, Clock::time_point> elsewhere_;  // peers that cannot import: retried after this
  uint64_t blocks_ = 0;
};

}  // namespace kvferry::daemon

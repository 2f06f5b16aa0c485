#pragma once
// Membership: who the live daemons of a cluster are (DESIGN.md §4 "Past one machine"). Each daemon
// publishes a MemberRecord; a Membership keeps the current view and tells a listener when members
// join, change incarnation or leave, and when this daemon itself loses its place (lease lost, etcd
// unreachable). Two implementations: etcd v3 (a leased record under a cluster prefix, kept alive
// every TTL/3, the prefix read once and then watched from that revision) and a static peer list
// (`tiers.remote.peers`) for small set-ups, where every configured peer counts as live.
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/layouts/status.h"

namespace kvferry::store {

/// What one daemon tells the cluster about itself. Serialised as a small JSON object.
struct MemberRecord {
  std::string id;                    ///< stable daemon name (placement hashes it), unique in the cluster
  uint64_t incarnation = 0;          ///< changes on every restart: a peer drops cached endpoints and rkeys
  std::string address;               ///< transport address: "host:port" of the listener or a hex worker address
  uint64_t pool_bytes = 0;           ///< host pool geometry: total bytes
  uint64_t slot_align = 0;           ///< and the slot alignment
  std::vector<std::string> formats;  ///< EntryFormat names this daemon stores
  bool operator==(const MemberRecord&) const = default;

  std::string to_json() const;
  /// Parses a record; kProtocol on malformed JSON or a missing id.
  static Result<MemberRecord> from_json(std::string_view json);
};

enum class MembershipEventType : uint8_t {
  kJoined,    ///< a member appeared
  kUpdated,   ///< a member's record changed (a new incarnation: drop what was cached for it)
  kLeft,      ///< a member's record is gone (lease expired or revoked)
  kLost,      ///< this daemon lost its lease or its connection to etcd: stop serving remote reads
  kRestored,  ///< this daemon holds a lease again after kLost
};

struct MembershipEvent {
  MembershipEventType type = MembershipEventType::kJoined;
  MemberRecord member;  ///< the member concerned (self for kLost/kRestored)
  std::string reason;   ///< for kLost: why
};

/// A cluster view. members()/health()/wait_until() are thread-safe. The view (and health) change
/// first, then the listener hears of it. The listener is called on the
/// membership's own thread, one event at a time, in order; it must not block for long and must not
/// call stop().
class Membership {
 public:
  using Listener = std::function<void(const MembershipEvent&)>;
  virtual ~Membership() = default;

  /// Joins (publishes the record), reads the current members and starts following changes. Fails
  /// when the first join fails (etcd unreachable within the request timeout); later failures are
  /// retried in the background and reported as kLost / kRestored.
  virtual Status start() = 0;
  /// Leaves cleanly (etcd: revokes the lease, so peers see this member go at once) and stops the
  /// background thread. Idempotent; the destructor calls it.
  virtual void stop() = 0;

  /// This daemon's record (with the incarnation chosen at creation).
  virtual const MemberRecord& self() const = 0;
  /// The live members, self included, sorted by id.
  virtual std::vector<MemberRecord> members() const = 0;
  /// Ok while this daemon holds its place; kUnavailable with the reason when its lease is lost or
  /// etcd cannot be reached.
  virtual Status health() const = 0;
  /// Waits until `pred(members())` holds or `timeout` passes; returns whether it held. Wakes on
  /// every change of the view or of health (no polling).
  virtual bool wait_until(const std::function<bool(const std::vector<MemberRecord>&)>& pred,
                          std::chrono::milliseconds timeout) const = 0;
  /// Set before start().
  virtual void set_listener(Listener listener) = 0;
};

/// etcd v3 through its JSON gateway (`/v3/kv/*`, `/v3/lease/*`, `/v3/watch`).
struct EtcdMembershipOptions {
  std::string endpoint = "http://127.0.0.1:2379";   ///< http://host:port (IP literal or a resolvable name)
  std::string prefix = "/kvferry/members/";         ///< the cluster's key prefix; a member is prefix + id
  std::chrono::seconds ttl{10};                     ///< lease TTL; keepalive every ttl/3
  std::chrono::milliseconds request_timeout{2000};  ///< each unary call (connect + request + reply)
  std::chrono::milliseconds retry_interval{500};    ///< between rejoin attempts after kLost
  std::function<void(const std::string&)> log;      ///< warnings; stderr when empty
};

/// A member of the cluster kept in etcd. `self.incarnation == 0` picks one (the wall clock in ns,
/// so a restarted daemon's is larger than its previous one's).
Result<std::unique_ptr<Membership>> make_etcd_membership(const EtcdMembershipOptions& opts, MemberRecord self);

/// A fixed cluster: self plus `peers`, all live for as long as it runs (`tiers.remote.peers`).
/// Duplicate ids are rejected (kInvalidArgument).
Result<std::unique_ptr<Membership>> make_static_membership(MemberRecord self, std::vector<MemberRecord> peers);

}  // namespace kvferry::store

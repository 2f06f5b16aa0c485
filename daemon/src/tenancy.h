#pragma once
// Who a peer is: the credentials the kernel vouches for at connect(), and the identity (tenant,
// region owner, admin) its session acts as once the Hello is settled against the configuration.
#include <sys/socket.h>

#include <cstdint>
#include <string>
#include <vector>

namespace kvferry::daemon {

/// The owner of what an admin session without a tenant creates: not a valid tenant name, so it
/// never collides with one.
constexpr const char* kAdminOwner = "@admin";

/// A peer's credentials as the kernel vouches for them at connect(): uid, primary gid, pid and
/// every group (primary first, then the supplementary ones).
struct Creds {
  uint32_t uid = 0, gid = 0, pid = 0;
  std::vector<uint32_t> groups;
};

/// "uid U gid G [groups A,B] pid P", for log lines and refusals.
std::string creds_text(const Creds& c);

/// The peer's supplementary groups. SO_PEERGROUPS (Linux 4.13) returns them as the kernel saw
/// them at connect(), with no race. Where it is missing, the `Groups:` line of /proc/<pid>/status
/// is read right after accept: the pid may have exited and been reused by then, so that answer is
/// only taken when the same file's effective uid still matches SO_PEERCRED's (a reused pid of
/// another user is then ignored; one of the same user could still show its own groups). Nothing
/// readable: the primary gid only.
std::vector<uint32_t> peer_groups(int fd, const ucred& cr);

/// The owner a client of block-namespace tenant `tenant` has (Daemon::Impl::identify): the tenant
/// itself, "uid:N" for a per-uid tenant ("uid:N/claimed" included), the admins' owner for "".
std::string owner_of_tenant(const std::string& tenant);

/// Who a session acts as, settled at its Hello from its credentials (never from the claim alone).
struct Identity {
  std::string tenant;  ///< ClientChannel::tenant: the block namespace's tenant part
  std::string owner;   ///< owner of the regions it creates and the key of its quotas
  bool admin = false;  ///< sees and manages every tenant's regions, clients and blocks; no quotas
};

}  // namespace kvferry::daemon

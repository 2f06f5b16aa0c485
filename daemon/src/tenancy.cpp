// Credentials and tenancy: what the kernel says a peer is, whether it may connect, and the
// tenant, owner, quotas and admin rights its session gets from the configuration.
#include "daemon_impl.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <fstream>
#include <sstream>

namespace kvferry::daemon {

namespace {

template <class T>
bool contains(const std::vector<T>& v, const T& x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

bool any_of_in(const std::vector<uint32_t>& have, const std::vector<uint32_t>& allowed) {
  for (uint32_t g : have)
    if (contains(allowed, g)) return true;
  return false;
}

}  // namespace

std::string creds_text(const Creds& c) {
  std::string s = "uid " + std::to_string(c.uid) + " gid " + std::to_string(c.gid);
  if (c.groups.size() > 1) {
    s += " groups";
    for (size_t i = 1; i < c.groups.size(); ++i) s += (i == 1 ? " " : ",") + std::to_string(c.groups[i]);
  }
  return s + " pid " + std::to_string(c.pid);
}

std::vector<uint32_t> peer_groups(int fd, const ucred& cr) {
  std::vector<uint32_t> out{static_cast<uint32_t>(cr.gid)};
  auto add = [&](uint32_t g) {
    if (!contains(out, g)) out.push_back(g);
  };
#ifdef SO_PEERGROUPS
  {
    std::vector<gid_t> gs(64);
    for (int attempt = 0; attempt < 3; ++attempt) {
      socklen_t len = static_cast<socklen_t>(gs.size() * sizeof(gid_t));
      if (::getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, gs.data(), &len) == 0) {
        for (size_t i = 0; i < len / sizeof(gid_t); ++i) add(static_cast<uint32_t>(gs[i]));
        return out;
      }
      if (errno != ERANGE || len / sizeof(gid_t) > 65536) break;
      gs.resize(len / sizeof(gid_t) + 1);
    }
  }
#else
  (void)fd;
#endif
  std::ifstream f("/proc/" + std::to_string(cr.pid) + "/status");
  std::string line;
  std::vector<uint32_t> groups;
  bool uid_ok = false, have_groups = false;
  while (std::getline(f, line)) {
    std::istringstream in(line.substr(line.find(':') == std::string::npos ? line.size() : line.find(':') + 1));
    if (line.rfind("Uid:", 0) == 0) {
      uint64_t real = 0, eff = 0;
      uid_ok = static_cast<bool>(in >> real >> eff) && eff == cr.uid;
    } else if (line.rfind("Groups:", 0) == 0) {
      have_groups = true;
      uint64_t g;
      while (in >> g && groups.size() < 65536) groups.push_back(static_cast<uint32_t>(g));
    }
  }
  if (uid_ok && have_groups)
    for (uint32_t g : groups) add(g);
  return out;
}

std::string owner_of_tenant(const std::string& tenant) {
  std::string owner = tenant.empty() ? kAdminOwner : tenant;
  if (owner.rfind("uid:", 0) == 0) owner = owner.substr(0, owner.find('/'));
  return owner;
}

bool Daemon::Impl::allowed(const Creds& c) const {
  const auto& u = cfg.daemon.allowed_uids;
  const auto& g = cfg.daemon.allowed_gids;
  if (u.empty() && g.empty()) return c.uid == 0 || c.uid == ::getuid();
  return contains(u, c.uid) || any_of_in(c.groups, g);
}

bool Daemon::Impl::is_admin(const Creds& c) const {
  return contains(cfg.daemon.admin_uids, c.uid) || any_of_in(c.groups, cfg.daemon.admin_gids);
}

Result<Identity> Daemon::Impl::identify(const Creds& c, const std::string& claimed) const {
  Identity id;
  id.admin = is_admin(c);
  if (cfg.tenants.empty()) {
    // One implicit tenant per uid; an admin acts as whatever tenant it names.
    const std::string u = "uid:" + std::to_string(c.uid);
    if (id.admin) {
      id.tenant = claimed;
      id.owner = claimed.empty() ? kAdminOwner : claimed;
    } else {
      id.tenant = claimed.empty() ? u : u + "/" + claimed;
      id.owner = u;
    }
    return id;
  }
  auto member = [&](const config::TenantConfig& t) { return contains(t.uids, c.uid) || any_of_in(c.groups, t.gids); };
  const config::TenantConfig* pick = nullptr;
  if (claimed.empty()) {
    for (const auto& t : cfg.tenants)
      if (member(t)) {
        pick = &t;
        break;
      }
    if (!pick && !id.admin)
      return Status(ErrorCode::kPermissionDenied,
                    creds_text(c) + " belongs to no tenant (see tenants[].uids and tenants[].gids)");
  } else {
    for (const auto& t : cfg.tenants)
      if (t.name == claimed) {
        pick = &t;
        break;
      }
    if (!id.admin && (!pick || !member(*pick))) {
      std::string mine;
      for (const auto& t : cfg.tenants)
        if (member(t)) mine += (mine.empty() ? "" : ", ") + t.name;
      return Status(ErrorCode::kPermissionDenied,
                    creds_text(c) + " may not use tenant '" + claimed + "' (" +
                        (mine.empty() ? "it belongs to no tenant" : "its tenants: " + mine) + ")");
    }
  }
  id.tenant = pick ? pick->name : claimed;
  id.owner = id.tenant.empty() ? kAdminOwner : id.tenant;
  return id;
}

config::TenantQuota Daemon::Impl::quota_for(const Identity& id) const {
  config::TenantQuota q;
  for (const auto& t : cfg.tenants)
    if (t.name == id.owner) q = t.quota;
  const config::TenantQuota& def = cfg.limits.tenant;
  if (!q.clients) q.clients = def.clients;
  if (!q.regions) q.regions = def.regions;
  if (!q.region_bytes) q.region_bytes = def.region_bytes;
  if (!q.inflight_bytes) q.inflight_bytes = def.inflight_bytes;
  if (!q.pinned_bytes) q.pinned_bytes = def.pinned_bytes ? def.pinned_bytes : cfg.host.capacity / 2;
  return q;
}

Daemon::Impl::Viewer Daemon::Impl::viewer_for(const Creds& c) const {
  auto who = identify(c, "");
  if (!who.ok()) return Viewer{false, ""};
  return Viewer{who->admin, who->owner};
}

}  // namespace kvferry::daemon

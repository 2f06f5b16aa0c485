// Imports of this daemon's regions by peer daemons on its host (daemon_impl.h, PeerGrant): the
// grants the remote tier asks for, the Hello that uses one, and the check of a peer's landing.
#include <random>

#include "daemon_impl.h"

namespace kvferry::daemon {

namespace {

/// How long a grant waits for the importing session's Hello.
constexpr auto kGrantLapses = std::chrono::seconds(30);
/// Grants outstanding at most (unused and in use): a peer asking for more is refused.
constexpr size_t kMaxGrants = 4096;

/// 128 random bits as 32 hex digits.
std::string new_token() {
  std::random_device rd;
  static constexpr char kHex[] = "0123456789abcdef";
  std::string t;
  for (int i = 0; i < 4; ++i) {
    const uint32_t v = rd();
    for (int k = 0; k < 8; ++k) t.push_back(kHex[(v >> (4 * k)) & 15]);
  }
  return t;
}

}  // namespace

void Daemon::Impl::drop_grants_locked(uint32_t session) {
  const auto now = Clock::now();
  for (auto it = grants.begin(); it != grants.end();) {
    const bool gone = it->second.session ? it->second.session == session : it->second.lapses < now;
    it = gone ? grants.erase(it) : std::next(it);
  }
}

Result<std::string> Daemon::Impl::grant_import(const std::string& tenant, uint32_t region) {
  auto r = find_region_for_tenant(tenant, region);
  if (!r)
    return Status(ErrorCode::kNotFound,
                  "no region " + std::to_string(region) + " of tenant '" + tenant + "' on this daemon");
  std::string token = new_token();
  std::lock_guard<std::mutex> g(mu);
  drop_grants_locked(0);
  if (grants.size() >= kMaxGrants)
    return Status(ErrorCode::kResourceExhausted, std::to_string(grants.size()) + " region imports are outstanding");
  grants[token] = PeerGrant{tenant, region, r, Clock::now() + kGrantLapses, 0};
  return token;
}

Result<Identity> Daemon::Impl::take_grant(const std::string& token, uint32_t session, uint32_t* region) {
  std::lock_guard<std::mutex> g(mu);
  drop_grants_locked(0);
  auto it = grants.find(token);
  if (it == grants.end() || it->second.session != 0)
    return Status(ErrorCode::kPermissionDenied,
                  "the Hello's peer token is unknown, used or lapsed (a peer daemon asks for one over the remote "
                  "tier before it connects)");
  it->second.session = session;
  *region = it->second.region;
  Identity id;
  id.tenant = it->second.tenant;
  id.owner = owner_of_tenant(it->second.tenant);
  return id;
}

std::vector<Status> Daemon::Impl::check_landed(const std::string& token, const std::string& tenant, uint32_t region,
                                               std::span<const int64_t> ids) const {
  Status bad = Status::Ok();
  std::shared_ptr<Region> r;
  {
    std::lock_guard<std::mutex> g(mu);
    auto it = grants.find(token);
    auto reg = regions.find(region);
    if (it == grants.end() || it->second.session == 0)
      bad = Status(ErrorCode::kNotFound, "the import of region " + std::to_string(region) +
                                             " is not known here (its session closed, or this daemon restarted)");
    else if (it->second.tenant != tenant || it->second.region != region)
      bad = Status(ErrorCode::kPermissionDenied, "the import was granted for another region or tenant");
    else if (reg == regions.end() || reg->second.region != it->second.what.lock())
      bad = Status(ErrorCode::kNotFound,
                   "region " + std::to_string(region) + " was removed or replaced since it was imported");
    else
      r = reg->second.region;
  }
  std::vector<Status> out;
  out.reserve(ids.size());
  for (int64_t id : ids) out.push_back(bad.ok() ? r->desc().spec.check_block(id) : bad);
  return out;
}

}  // namespace kvferry::daemon

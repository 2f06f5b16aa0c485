#pragma once
// A two-host network on one machine for a test: a veth pair whose far end lives in a network
// namespace the test makes, each end with an address of one /30. The namespace and the link are
// the test's own and are removed with this object. Needs root and a working `ip netns`.
#include <unistd.h>

#include <cstdlib>
#include <string>

namespace kvferry::testing {

/// Runs `cmd` through the shell, its output discarded; the exit status.
inline int sh(const std::string& cmd) { return std::system((cmd + " >/dev/null 2>&1").c_str()); }

class NetnsLink {
 public:
  /// Makes namespace `<name>-<tag>` (tag: this process's pid, so parallel runs do not meet); the
  /// veth ends are `<veth>a<tag>` (here) and `<veth>b<tag>` (there), on 10.`net`.X.0/30.
  /// made() says whether the namespace could be made; link() then wires and raises the ends.
  NetnsLink(const std::string& name, const std::string& veth, int net) {
    const std::string tag = std::to_string(::getpid() % 100000);
    ns_ = name + "-" + tag;
    near_ = veth + "a" + tag;
    far_ = veth + "b" + tag;
    const std::string sub = "10." + std::to_string(net) + "." + std::to_string(100 + int(::getpid() % 100));
    near_ip_ = sub + ".1";
    far_ip_ = sub + ".2";
    made_ = sh("ip netns add " + ns_) == 0;
  }
  ~NetnsLink() {
    if (!made_) return;
    sh("ip link del " + near_);
    sh("ip netns del " + ns_);
  }
  NetnsLink(const NetnsLink&) = delete;
  NetnsLink& operator=(const NetnsLink&) = delete;

  bool made() const { return made_; }

  /// Creates the veth pair, moves its far end into the namespace, sets the addresses and raises
  /// both ends and the namespace's loopback. "" when done, else the command that failed.
  std::string link() const {
    for (const std::string& cmd : {
             "ip link add " + near_ + " type veth peer name " + far_,
             "ip link set " + far_ + " netns " + ns_,
             "ip addr add " + near_ip_ + "/30 dev " + near_,
             "ip link set " + near_ + " up",
             "ip netns exec " + ns_ + " ip addr add " + far_ip_ + "/30 dev " + far_,
             "ip netns exec " + ns_ + " ip link set " + far_ + " up",
             "ip netns exec " + ns_ + " ip link set lo up",
         })
      if (sh(cmd) != 0) return cmd;
    return "";
  }

  /// Cuts the cable: deletes the near end (its peer goes with it), so no RST and no FIN reach
  /// either side. True when it was deleted.
  bool cut() const { return sh("ip link del " + near_) == 0; }

  const std::string& ns() const { return ns_; }            ///< the namespace (for `ip netns exec`)
  const std::string& near_ip() const { return near_ip_; }  ///< the address of this side
  const std::string& far_ip() const { return far_ip_; }    ///< the address inside the namespace

 private:
  std::string ns_, near_, far_, near_ip_, far_ip_;
  bool made_ = false;
};

}  // namespace kvferry::testing

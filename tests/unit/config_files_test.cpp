// The files the repo ships: every YAML under deploy/ and deploy/examples/ loads, the default
// config has the shape the docs promise, and the systemd units pass `systemd-analyze verify`.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "kvferry/config/config.h"

namespace kvferry::config {
namespace {

namespace fs = std::filesystem;

const fs::path kSource = KVFERRY_SOURCE_DIR;

std::vector<fs::path> yaml_files() {
  std::vector<fs::path> out;
  for (const fs::path& dir : {kSource / "deploy", kSource / "deploy" / "examples"}) {
    if (!fs::is_directory(dir)) continue;
    for (const auto& e : fs::directory_iterator(dir)) {
      const std::string ext = e.path().extension().string();
      if (e.is_regular_file() && (ext == ".yaml" || ext == ".yml")) out.push_back(e.path());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string read(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(ConfigFiles, EveryRepoYamlLoadsAndRoundTrips) {
  const auto files = yaml_files();
  ASSERT_GE(files.size(), 4u) << "expected deploy/kvferry.yaml and the examples under " << kSource;
  for (const fs::path& p : files) {
    SCOPED_TRACE(p.string());
    Result<Config> c = load_file(p.string());
    ASSERT_TRUE(c.ok()) << c.status().message();
    Result<Config> back = load_string(to_yaml(*c), "to_yaml");
    ASSERT_TRUE(back.ok()) << back.status().message();
    EXPECT_EQ(*back, *c);
  }
}

TEST(ConfigFiles, DefaultConfigIsCpuFriendlyWithADemoRegion) {
  Result<Config> r = load_file((kSource / "deploy" / "kvferry.yaml").string());
  ASSERT_TRUE(r.ok()) << r.status().message();
  const Config& c = *r;
  EXPECT_EQ(c.daemon.socket.rfind("/run/kvferry/", 0), 0u) << c.daemon.socket;
  EXPECT_EQ(c.device.backend, Backend::kAuto);
  EXPECT_LE(c.host.capacity, 1ull << 30);
  ASSERT_EQ(c.regions.size(), 1u);
  const KvCacheSpec& s = c.regions[0].spec;
  EXPECT_TRUE(s.format.is_mla());
  EXPECT_EQ(s.layout, Layout::kBlockMajor);
  EXPECT_GE(s.layers, 2);
  EXPECT_LE(s.region_bytes(), int64_t{64} << 20) << "the default region should stay small";
  EXPECT_TRUE(s.validate().ok());
  // Every key of the schema appears in the default file, so it documents all of them.
  const std::string text = read(kSource / "deploy" / "kvferry.yaml");
  for (const KeyDoc& d : schema()) {
    const std::string leaf = d.key.substr(d.key.find_last_of(".]") + 1);
    EXPECT_NE(text.find(leaf + ":"), std::string::npos) << d.key << " is not in deploy/kvferry.yaml";
  }
}

// ---- systemd units ----

struct CmdResult {
  int rc;
  std::string out;
};

CmdResult run(const std::string& cmd) {
  CmdResult r{-1, {}};
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  const int st = ::pclose(p);
  r.rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

std::string find_tool(const char* name) {
  const char* path = std::getenv("PATH");
  std::stringstream ss(std::string(path ? path : "") + ":/usr/bin:/bin");
  std::string dir;
  while (std::getline(ss, dir, ':'))
    if (!dir.empty() && ::access((dir + "/" + name).c_str(), X_OK) == 0) return dir + "/" + name;
  return "";
}

class Units : public ::testing::Test {
 protected:
  void SetUp() override {
    tool_ = find_tool("systemd-analyze");
    char tmpl[] = "/tmp/kvferry-units-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  // The unit with ExecStart pointed at a binary that exists here (verify checks it is executable).
  fs::path stage(const std::string& name, const std::string& text) {
    std::string t = text;
    const std::string self = fs::read_symlink("/proc/self/exe").string();
    for (size_t at; (at = t.find("/usr/bin/kvferryd")) != std::string::npos;) t.replace(at, 17, self);
    const fs::path p = dir_ / name;
    std::ofstream(p) << t;
    return p;
  }
  CmdResult verify(const fs::path& unit) { return run("'" + tool_ + "' verify --man=no '" + unit.string() + "'"); }

  std::string tool_;
  fs::path dir_;
};

std::multimap<std::string, std::string> directives(const std::string& text) {
  std::multimap<std::string, std::string> m;
  std::stringstream ss(text);
  std::string line;
  while (std::getline(ss, line)) {
    if (line.empty() || line[0] == '#' || line[0] == '[') continue;
    const size_t eq = line.find('=');
    if (eq != std::string::npos) m.emplace(line.substr(0, eq), line.substr(eq + 1));
  }
  return m;
}

TEST_F(Units, VerifyCleanly) {
  if (tool_.empty()) GTEST_SKIP() << "systemd-analyze not found (scripts/setup.sh installs the systemd package)";
  const fs::path main = stage("kvferryd.service", read(kSource / "deploy" / "kvferryd.service"));
  stage("kvferryd@.service", read(kSource / "deploy" / "kvferryd@.service"));
  for (const fs::path& unit : {main, dir_ / "kvferryd@0.service", dir_ / "kvferryd@7.service"}) {
    const CmdResult r = verify(unit);
    EXPECT_EQ(r.rc, 0) << unit << ":\n" << r.out;
    EXPECT_EQ(r.out, "") << unit << ": systemd-analyze verify complained:\n" << r.out;
  }
}

TEST_F(Units, VerifyCatchesABrokenUnit) {
  if (tool_.empty()) GTEST_SKIP() << "systemd-analyze not found (scripts/setup.sh installs the systemd package)";
  std::string text = read(kSource / "deploy" / "kvferryd.service");
  const size_t at = text.find("Type=notify");
  ASSERT_NE(at, std::string::npos);
  text.replace(at, 11, "Type=notfy");
  const CmdResult r = verify(stage("kvferryd.service", text));
  EXPECT_NE(r.out.find("notfy"), std::string::npos) << r.out;
}

TEST(UnitsContent, RequiredDirectives) {
  for (const char* name : {"kvferryd.service", "kvferryd@.service"}) {
    SCOPED_TRACE(name);
    const std::string text = read(kSource / "deploy" / name);
    ASSERT_FALSE(text.empty());
    const auto d = directives(text);
    auto one = [&](const std::string& k) { return d.count(k) ? d.find(k)->second : std::string("<absent>"); };
    EXPECT_EQ(one("Type"), "notify");
    EXPECT_NE(one("WatchdogSec"), "<absent>");
    EXPECT_NE(one("RuntimeDirectory").find("kvferry"), std::string::npos);
    EXPECT_EQ(one("LimitMEMLOCK"), "infinity");
    EXPECT_EQ(one("ExecReload"), "/bin/kill -HUP $MAINPID");
    EXPECT_EQ(one("ProtectSystem"), "strict");
    EXPECT_EQ(one("ProtectHome"), "true");
    EXPECT_EQ(one("NoNewPrivileges"), "true");
    EXPECT_EQ(one("PrivateTmp"), "true");
    EXPECT_NE(one("PrivateDevices"), "true") << "PrivateDevices hides /dev/nvidia*";
    bool nvidia = false;
    for (auto [it, end] = d.equal_range("DeviceAllow"); it != end; ++it)
      nvidia |= it->second.find("nvidia") != std::string::npos;
    EXPECT_TRUE(nvidia) << "no DeviceAllow for the NVIDIA device nodes";
    EXPECT_NE(one("ExecStart").find("/usr/bin/kvferryd --config "), std::string::npos);
  }
  // The template's instance gets its own config and socket directory.
  const auto t = directives(read(kSource / "deploy" / "kvferryd@.service"));
  EXPECT_NE(t.find("ExecStart")->second.find("%i"), std::string::npos);
  EXPECT_NE(t.find("RuntimeDirectory")->second.find("%i"), std::string::npos);
}

}  // namespace
}  // namespace kvferry::config

#include <utility>  // before Asio

#include <gtest/gtest.h>

#include <boost/asio.hpp>
#include <chrono>
#include <string>
#include <thread>
#include <utility>

#include "kvferry/store/http_server.h"

namespace kvferry::store {
namespace {

namespace asio = boost::asio;

// A plain blocking HTTP/1.0 GET on loopback; returns the whole response.
std::string get(uint16_t port, const std::string& path, const std::string& method = "GET") {
  asio::io_context io;
  asio::ip::tcp::socket s(io);
  s.connect({asio::ip::make_address("127.0.0.1"), port});
  const std::string req = method + " " + path + " HTTP/1.0\r\nHost: localhost\r\n\r\n";
  asio::write(s, asio::buffer(req));
  std::string out;
  boost::system::error_code ec;
  char buf[4096];
  for (int i = 0; i < 1000; ++i) {
    const size_t n = s.read_some(asio::buffer(buf), ec);
    out.append(buf, n);
    if (ec) break;
  }
  return out;
}

TEST(HttpServer, ServesMetricsHealthAndErrors) {
  asio::io_context io;
  bool healthy = true;
  HttpServer::Handlers h;
  h.metrics = [] { return std::string("kvferry_up 1\n"); };
  h.health = [&](std::string* body) {
    *body = healthy ? "ok\n" : "host pool missing\n";
    return healthy;
  };
  auto srv = HttpServer::start(io, "127.0.0.1:0", h);
  ASSERT_TRUE(srv.ok()) << srv.status().to_string();
  const uint16_t port = (*srv)->port();
  ASSERT_GT(port, 0);
  std::thread t([&] { io.run_for(std::chrono::seconds(20)); });
  const std::string m = get(port, "/metrics");
  EXPECT_NE(m.find("200 OK"), std::string::npos) << m;
  EXPECT_NE(m.find("text/plain; version=0.0.4"), std::string::npos) << m;
  EXPECT_NE(m.find("kvferry_up 1"), std::string::npos) << m;
  EXPECT_NE(get(port, "/healthz").find("200 OK"), std::string::npos);
  healthy = false;
  const std::string bad = get(port, "/healthz");
  EXPECT_NE(bad.find("503"), std::string::npos) << bad;
  EXPECT_NE(bad.find("host pool missing"), std::string::npos) << bad;
  EXPECT_NE(get(port, "/nope").find("404"), std::string::npos);
  EXPECT_NE(get(port, "/metrics", "POST").find("405"), std::string::npos);
  (*srv)->stop();
  io.stop();
  t.join();
}

TEST(HttpServer, BadListenAddressesAreClearErrors) {
  asio::io_context io;
  // The message names what is wrong: the whole address, its port, or its host. Signs and spaces
  // in the port are refused, as the config key refuses them (one host:port parser).
  const std::pair<const char*, const char*> cases[] = {
      {"", "is not host:port"},
      {"9464", "is not host:port"},
      {":9464", "is not host:port"},
      {"127.0.0.1:", "metrics port ''"},
      {"127.0.0.1:99999", "metrics port '99999'"},
      {"127.0.0.1:12ab", "metrics port '12ab'"},
      {"127.0.0.1:+80", "metrics port '+80'"},
      {"127.0.0.1: 80", "metrics port ' 80'"},
      {"127.0.0.1:-1", "metrics port '-1'"},
      {"nohost:80", "metrics host 'nohost' is not an IP address"},
  };
  for (const auto& [bad, what] : cases) {
    auto s = HttpServer::start(io, bad, {});
    ASSERT_FALSE(s.ok()) << bad;
    EXPECT_EQ(s.status().code(), ErrorCode::kConfig) << bad << ": " << s.status().to_string();
    EXPECT_NE(s.status().message().find(what), std::string::npos) << bad << ": " << s.status().to_string();
  }
}

// Port 0 picks a free port; "localhost" is the IPv4 loopback.
TEST(HttpServer, PortZeroAndLocalhostListen) {
  asio::io_context io;
  for (const char* ok : {"localhost:0", "127.0.0.1:0"}) {
    auto s = HttpServer::start(io, ok, {});
    ASSERT_TRUE(s.ok()) << ok << ": " << s.status().to_string();
    EXPECT_NE((*s)->port(), 0) << ok;
    (*s)->stop();
  }
}

}  // namespace
}  // namespace kvferry::store

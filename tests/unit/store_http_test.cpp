#include <utility>  // before Asio

#include <gtest/gtest.h>

#include <boost/asio.hpp>
#include <chrono>
#include <string>
#include <thread>

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
  for (const char* bad : {"", "9464", "127.0.0.1:", "127.0.0.1:99999", "nohost:80", "127.0.0.1:12ab"}) {
    auto s = HttpServer::start(io, bad, {});
    EXPECT_FALSE(s.ok()) << bad;
    EXPECT_EQ(s.status().code(), ErrorCode::kConfig) << bad << ": " << s.status().to_string();
  }
}

}  // namespace
}  // namespace kvferry::store

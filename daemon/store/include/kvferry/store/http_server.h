#pragma once
// A small HTTP/1.1 server (Boost.Beast) for GET /metrics (Prometheus text) and GET /healthz on
// the daemon's io_context. One request per connection is enough for scrapers; every connection
// has a deadline so a slow client cannot hold the daemon.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "kvferry/layouts/status.h"

namespace boost::asio {
class io_context;
}

namespace kvferry::store {

class HttpServer {
 public:
  struct Handlers {
    std::function<std::string()> metrics;      ///< body of /metrics
    std::function<bool(std::string*)> health;  ///< true = healthy; fills a one-line body
  };

  /// Listens on `listen` ("host:port"; port 0 picks a free one) and serves on `io`.
  static Result<std::unique_ptr<HttpServer>> start(boost::asio::io_context& io, const std::string& listen,
                                                   Handlers handlers);
  ~HttpServer();
  /// The bound port (useful with port 0).
  uint16_t port() const;
  void stop();

 private:
  struct Impl;
  explicit HttpServer(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

}  // namespace kvferry::store

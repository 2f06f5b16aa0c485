#include <utility>  // before Asio (Boost 1.74 + C++20)

#include "kvferry/store/http_server.h"

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>

#include "kvferry/config/host_port.h"

namespace kvferry::store {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

struct HttpServer::Impl : std::enable_shared_from_this<HttpServer::Impl> {
  Impl(asio::io_context& io, Handlers h) : acceptor(io), backoff(io), handlers(std::move(h)) {}
  tcp::acceptor acceptor;
  asio::steady_timer backoff;
  Handlers handlers;
  bool stopped = false;

  void accept() {
    acceptor.async_accept([self = shared_from_this()](beast::error_code ec, tcp::socket sock) {
      if (self->stopped) return;
      if (!ec) {
        self->serve(std::move(sock));
        return self->accept();
      }
      // An accept that fails (out of fds, most often) would fail again at once: wait a little
      // instead of spinning, while the rest of the daemon serves on.
      self->backoff.expires_after(std::chrono::milliseconds(100));
      self->backoff.async_wait([self](beast::error_code) {
        if (!self->stopped) self->accept();
      });
    });
  }

  void serve(tcp::socket sock) {
    struct Conn {
      explicit Conn(tcp::socket s) : stream(std::move(s)) {}
      beast::tcp_stream stream;
      beast::flat_buffer buf;
      http::request<http::string_body> req;
      http::response<http::string_body> res;
    };
    auto c = std::make_shared<Conn>(std::move(sock));
    c->stream.expires_after(std::chrono::seconds(5));
    http::async_read(c->stream, c->buf, c->req, [self = shared_from_this(), c](beast::error_code ec, size_t) {
      if (ec) return;
      c->res.version(c->req.version());
      c->res.keep_alive(false);
      const std::string target(c->req.target());
      if (c->req.method() != http::verb::get) {
        c->res.result(http::status::method_not_allowed);
        c->res.body() = "only GET is served\n";
      } else if (target == "/metrics") {
        c->res.result(http::status::ok);
        c->res.set(http::field::content_type, "text/plain; version=0.0.4");
        c->res.body() = self->handlers.metrics ? self->handlers.metrics() : "";
      } else if (target == "/healthz") {
        std::string body = "ok\n";
        const bool ok = self->handlers.health ? self->handlers.health(&body) : true;
        c->res.result(ok ? http::status::ok : http::status::service_unavailable);
        c->res.body() = body;
      } else {
        c->res.result(http::status::not_found);
        c->res.body() = "not found: try /metrics or /healthz\n";
      }
      c->res.prepare_payload();
      http::async_write(c->stream, c->res, [c](beast::error_code, size_t) {
        beast::error_code ignored;
        c->stream.socket().shutdown(tcp::socket::shutdown_both, ignored);
      });
    });
  }
};

HttpServer::HttpServer(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
HttpServer::~HttpServer() { stop(); }

void HttpServer::stop() {
  if (!impl_ || impl_->stopped) return;
  impl_->stopped = true;
  beast::error_code ec;
  impl_->acceptor.close(ec);
  impl_->backoff.cancel();
}

uint16_t HttpServer::port() const { return impl_->acceptor.local_endpoint().port(); }

Result<std::unique_ptr<HttpServer>> HttpServer::start(asio::io_context& io, const std::string& listen,
                                                      Handlers handlers) {
  config::HostPort hp;
  switch (config::parse_host_port(listen, &hp)) {
    case config::HostPortFault::kOk: break;
    case config::HostPortFault::kNotHostPort:
      return Result<std::unique_ptr<HttpServer>>(ErrorCode::kConfig,
                                                 "metrics address '" + listen + "' is not host:port");
    case config::HostPortFault::kBadPort:
      return Result<std::unique_ptr<HttpServer>>(
          ErrorCode::kConfig, "metrics port '" + listen.substr(listen.rfind(':') + 1) + "' in '" + listen +
                                  "' is not a port number (decimal, 0 to 65535; 0 = any free port)");
  }
  const std::string& host = hp.host;
  beast::error_code ec;
  const auto addr = asio::ip::make_address(host == "localhost" ? "127.0.0.1" : host, ec);
  if (ec)
    return Result<std::unique_ptr<HttpServer>>(ErrorCode::kConfig, "metrics host '" + host + "' is not an IP address");
  auto impl = std::make_shared<Impl>(io, std::move(handlers));
  const tcp::endpoint ep(addr, hp.port);
  impl->acceptor.open(ep.protocol(), ec);
  if (!ec) impl->acceptor.set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) impl->acceptor.bind(ep, ec);
  if (!ec) impl->acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec)
    return Result<std::unique_ptr<HttpServer>>(ErrorCode::kIo,
                                               "cannot serve metrics on " + listen + ": " + ec.message());
  impl->accept();
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(impl)));
}

}  // namespace kvferry::store

#include "clients/load/http_get.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvlens::load {
namespace {

using Clock = std::chrono::steady_clock;

int RemainingMs(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return left.count() > 0 ? static_cast<int>(left.count()) : 0;
}

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

// Connects a non-blocking socket to one resolved address before `deadline`.
absl::StatusOr<int> Connect(const addrinfo* ai, Clock::time_point deadline) {
  const int fd =
      socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
  if (fd < 0) return absl::InternalError(std::strerror(errno));
  if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0 && errno != EINPROGRESS) {
    const int err = errno;
    close(fd);
    return absl::UnavailableError(std::strerror(err));
  }
  pollfd p{fd, POLLOUT, 0};
  int err = 0;
  socklen_t len = sizeof(err);
  if (poll(&p, 1, RemainingMs(deadline)) != 1 ||
      getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) {
    close(fd);
    return absl::UnavailableError(err != 0 ? std::strerror(err) : "connect timed out");
  }
  return fd;
}

}  // namespace

absl::Status SplitHostPort(const std::string& address, std::string& host, int& port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port <= 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", address, "' is not HOST:PORT (e.g. 127.0.0.1:9464)"));
  }
  host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return absl::OkStatus();
}

std::string UrlEncode(const std::string& s) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  for (const char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (std::isalnum(u) || c == '-' || c == '_' || c == '.' || c == '~') {
      out.push_back(c);
    } else {
      out.push_back('%');
      out.push_back(kHex[u >> 4]);
      out.push_back(kHex[u & 15]);
    }
  }
  return out;
}

absl::StatusOr<std::string> HttpGet(const std::string& host, int port, const std::string& path,
                                    std::chrono::milliseconds timeout) {
  const std::string url = absl::StrCat("http://", host, ":", port, path);
  const Clock::time_point deadline = Clock::now() + timeout;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (const int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
      rc != 0) {
    return absl::UnavailableError(absl::StrCat(url, ": ", gai_strerror(rc)));
  }
  absl::StatusOr<int> fd_or = absl::UnavailableError("no address");
  for (const addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    fd_or = Connect(ai, deadline);
    if (fd_or.ok()) break;
  }
  freeaddrinfo(res);
  if (!fd_or.ok()) return absl::UnavailableError(absl::StrCat(url, ": ", fd_or.status().message()));
  Fd fd(*fd_or);

  const std::string request = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: ", host, ":", port,
                                           "\r\nAccept: */*\r\nConnection: close\r\n\r\n");
  for (size_t sent = 0; sent < request.size();) {
    pollfd p{fd.get(), POLLOUT, 0};
    if (poll(&p, 1, RemainingMs(deadline)) != 1) {
      return absl::DeadlineExceededError(absl::StrCat(url, ": send timed out"));
    }
    const ssize_t n = send(fd.get(), request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno != EAGAIN && errno != EINTR) {
      return absl::UnavailableError(absl::StrCat(url, ": ", std::strerror(errno)));
    }
    if (n > 0) sent += static_cast<size_t>(n);
  }
  std::string response;
  char buf[16384];
  for (;;) {
    pollfd p{fd.get(), POLLIN, 0};
    if (poll(&p, 1, RemainingMs(deadline)) != 1) {
      return absl::DeadlineExceededError(absl::StrCat(url, ": no complete response in time"));
    }
    const ssize_t n = recv(fd.get(), buf, sizeof(buf), 0);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      return absl::UnavailableError(absl::StrCat(url, ": ", std::strerror(errno)));
    }
    response.append(buf, static_cast<size_t>(n));
  }
  const size_t body = response.find("\r\n\r\n");
  if (body == std::string::npos) {
    return absl::DataLossError(absl::StrCat(url, ": malformed HTTP response"));
  }
  const std::string status_line = response.substr(0, response.find("\r\n"));
  if (status_line.find(" 200") == std::string::npos) {
    return absl::UnavailableError(
        absl::StrCat(url, ": ", status_line, " ", response.substr(body + 4, 200)));
  }
  return response.substr(body + 4);
}

}  // namespace kvlens::load

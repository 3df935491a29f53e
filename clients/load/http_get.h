// A minimal blocking HTTP/1.0 GET over a plain socket, for scraping /metrics and asking
// Prometheus' HTTP API. No TLS, no redirects; bounded by a timeout on connect and reads.
#ifndef KVLENS_CLIENTS_LOAD_HTTP_GET_H_
#define KVLENS_CLIENTS_LOAD_HTTP_GET_H_

#include <chrono>
#include <string>

#include "absl/status/statusor.h"

namespace kvlens::load {

// GET http://host:port{path}; the body of a 200 response, else an error naming the URL.
absl::StatusOr<std::string> HttpGet(const std::string& host, int port, const std::string& path,
                                    std::chrono::milliseconds timeout);

// "host:port" → (host, port); IPv6 literals as "[::1]:port".
absl::Status SplitHostPort(const std::string& address, std::string& host, int& port);

// Percent-encodes everything but unreserved characters (RFC 3986), for query strings.
std::string UrlEncode(const std::string& s);

}  // namespace kvlens::load

#endif  // KVLENS_CLIENTS_LOAD_HTTP_GET_H_

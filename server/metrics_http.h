// MetricsHttpServer: the /metrics endpoint, a minimal HTTP/1.x server on its own thread.
//
// Why not prometheus-cpp's Exposer: it runs civetweb, whose threads are created with a
// fixed ~100 KB stack. A process that also links cuBLAS (the CUDA backend) carries
// libcublasLt's 94 KB of static TLS in every thread's stack, so civetweb's
// pthread_create fails with EINVAL and the exposer cannot start. This server's thread
// has the default stack, and it stops at once (civetweb's accept loop polled for ~2 s).
//
// GET /metrics (and HEAD) → 200 with the Prometheus text format from `render`; GET / → a
// short index; anything else → 404 (unknown path) or 405 (other methods). One connection
// at a time, each closed after its response; a client gets 5 s to send its request.
#ifndef KVLENS_SERVER_METRICS_HTTP_H_
#define KVLENS_SERVER_METRICS_HTTP_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace kvlens::server {

class MetricsHttpServer {
 public:
  using Render = std::function<std::string()>;

  // Listens on host:port (port 0: an ephemeral one); UNAVAILABLE naming the address.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const std::string& host, int port,
                                                                  Render render);
  ~MetricsHttpServer();  // stops the thread and closes the socket

  int port() const { return port_; }

 private:
  MetricsHttpServer(int listen_fd, int wake_fd_read, int wake_fd_write, int port, Render render);
  void Loop();
  void Serve(int fd);

  int listen_fd_;
  int wake_read_, wake_write_;  // a pipe that wakes the loop for shutdown
  int port_;
  Render render_;
  std::thread thread_;
};

}  // namespace kvlens::server

#endif  // KVLENS_SERVER_METRICS_HTTP_H_

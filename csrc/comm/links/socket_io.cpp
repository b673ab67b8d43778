#include "comm/links/socket_io.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace ddpkit::comm::socket_io {

Failure failure_in_news(const FrameHeader& news, int peer, const std::vector<int>& ranks) {
  const auto failed = static_cast<int64_t>(news.bytes);
  const auto known = std::find(ranks.begin(), ranks.end(), failed);
  const int about = known == ranks.end() ? peer : static_cast<int>(known - ranks.begin());
  return {about, c10::str("rank ", failed, " failed or died (rank ", ranks[peer], " reported it)"), failed};
}

std::string errno_text() { return std::strerror(errno); }

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, 1 << 30));
}

bool wait_for(int fd, short events, Clock::time_point deadline) {
  while (true) {
    pollfd entry{fd, events, 0};
    const int ready = ::poll(&entry, 1, remaining_ms(deadline));
    if (ready > 0) return true;
    if (ready == 0) return false;
    TORCH_CHECK(errno == EINTR, "poll failed: ", errno_text());
  }
}

void write_all(int fd, const void* data, size_t bytes, Clock::time_point deadline, const std::string& whom) {
  const char* at = static_cast<const char*>(data);
  while (bytes > 0) {
    TORCH_CHECK(wait_for(fd, POLLOUT, deadline), "timed out writing to ", whom);
    const ssize_t sent = ::send(fd, at, bytes, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (sent < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
    TORCH_CHECK(sent > 0, "writing to ", whom, " failed: ", errno_text());
    at += sent;
    bytes -= static_cast<size_t>(sent);
  }
}

void read_all(int fd, void* data, size_t bytes, Clock::time_point deadline, const std::string& whom) {
  char* at = static_cast<char*>(data);
  while (bytes > 0) {
    TORCH_CHECK(wait_for(fd, POLLIN, deadline), "timed out reading from ", whom);
    const ssize_t got = ::recv(fd, at, bytes, MSG_DONTWAIT);
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
    TORCH_CHECK(got != 0, whom, " closed the connection");
    TORCH_CHECK(got > 0, "reading from ", whom, " failed: ", errno_text());
    at += got;
    bytes -= static_cast<size_t>(got);
  }
}

}  // namespace ddpkit::comm::socket_io

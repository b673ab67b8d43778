#include "comm/shm/peer_watch.h"

#include "comm/core/fork_guard.h"

#include <c10/util/Exception.h>

#include <errno.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace ddpkit::comm {

namespace {

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434  // the same number on every architecture
#endif

// A pidfd of `pid`, -1 when the kernel offers none (ESRCH: already gone, reported by the caller).
int open_pidfd(int pid, int* error) {
  const long fd = syscall(SYS_pidfd_open, pid, 0);
  *error = fd < 0 ? errno : 0;
  return static_cast<int>(fd);
}

}  // namespace

PeerWatch::PeerWatch(const std::vector<int>& pids, int self, std::function<void(int)> exited)
    : fds_(pids.size(), -1), fork_generation_(fork_generation()), exited_(std::move(exited)) {
  std::vector<int> gone;
  for (size_t i = 0; i < pids.size(); ++i) {
    if (static_cast<int>(i) == self) continue;
    int error = 0;
    fds_[i] = open_pidfd(pids[i], &error);
    if (fds_[i] >= 0) {
      ++watched_;
    } else if (error == ESRCH) {
      gone.push_back(static_cast<int>(i));
    }
  }
  if (watched_ == 0 && gone.empty()) return;  // nothing to watch: the liveness check alone
  stop_fd_ = eventfd(0, EFD_CLOEXEC);
  if (stop_fd_ < 0) {
    for (int& fd : fds_) {
      if (fd >= 0) close(fd);
      fd = -1;
    }
    watched_ = 0;
    return;
  }
  for (int peer : gone) exited_(peer);
  thread_ = std::thread([this] { loop(); });
}

PeerWatch::~PeerWatch() {
  if (thread_.joinable()) {
    if (fork_generation() != fork_generation_) {
      thread_.detach();  // a forked child: the parent's thread does not exist here (Note [Forked children])
    } else {
      const uint64_t one = 1;
      const ssize_t written = write(stop_fd_, &one, sizeof(one));
      TORCH_INTERNAL_ASSERT(written == sizeof(one), "ddpkit: could not stop the peer watch");
      thread_.join();
    }
  }
  for (int fd : fds_)
    if (fd >= 0) close(fd);
  if (stop_fd_ >= 0) close(stop_fd_);
}

void PeerWatch::loop() {
  std::vector<pollfd> polled;
  std::vector<int> peer_of;
  polled.push_back(pollfd{stop_fd_, POLLIN, 0});
  peer_of.push_back(-1);
  for (size_t i = 0; i < fds_.size(); ++i) {
    if (fds_[i] < 0) continue;
    polled.push_back(pollfd{fds_[i], POLLIN, 0});
    peer_of.push_back(static_cast<int>(i));
  }
  for (;;) {
    const int ready = poll(polled.data(), polled.size(), -1);
    if (ready < 0) {
      if (errno == EINTR) continue;
      return;  // the liveness check still covers every peer
    }
    if (polled[0].revents != 0) return;
    for (size_t k = 1; k < polled.size(); ++k) {
      if (polled[k].revents == 0 || polled[k].fd < 0) continue;
      polled[k].fd = -1;  // poll() skips a negative fd: each exit is told once
      exited_(peer_of[k]);
    }
  }
}

}  // namespace ddpkit::comm

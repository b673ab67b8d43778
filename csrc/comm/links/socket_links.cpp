#include "comm/links/socket_links.h"

#include "comm/links/link_thread.h"
#include "comm/links/socket_io.h"

#include <c10/util/Exception.h>

#include <sys/socket.h>

#include <cstring>
#include <utility>

namespace ddpkit::comm {

using namespace socket_io;

SocketLinks::SocketLinks(int rank, std::vector<Fd> fds, std::vector<int> group_ranks, std::chrono::milliseconds timeout,
                         int refused, LinkThreading threading, std::optional<int> send_buffer_setting)
    : rank_(rank),
      fds_(std::move(fds)),
      group_ranks_(std::move(group_ranks)),
      send_buffers_(fds_, group_ranks_, send_buffer_setting),
      timeout_(timeout),
      refused_(refused),
      threading_(threading) {}

SocketLinks::~SocketLinks() {
  send_thread_.reset();  // their jobs stopped with their exchanges; the descriptors close after them
  receive_thread_.reset();
}

void SocketLinks::fail(int peer, const std::string& why, const std::vector<int>& cut_off) {
  failed_peer_ = peer;
  broken_ = why;
  // Hanging up tells a peer now, not at the timeout, that this rank gave up: the failed one, and
  // those whose frame from this rank stopped halfway (their stream can never be resumed).
  if (peer >= 0 && fds_[peer].get() >= 0) ::shutdown(fds_[peer].get(), SHUT_RDWR);
  for (int other : cut_off) ::shutdown(fds_[other].get(), SHUT_RDWR);
  TORCH_CHECK(false, why);
}

void SocketLinks::shut_down() noexcept {
  for (const Fd& fd : fds_) {
    if (fd.get() >= 0) ::shutdown(fd.get(), SHUT_RDWR);
  }
}

void SocketLinks::break_off(const std::string& why) noexcept {
  if (broken_.empty()) {
    try {
      broken_ = why.empty() ? std::string("this rank failed in a collective") : why;
    } catch (const std::exception&) {
      broken_ = "?";  // out of memory: the links still break
    }
  }
  shut_down();
}

void SocketLinks::send_last_words(uint64_t sequence, int peer, const void* data, int64_t bytes) noexcept {
  if (peer == rank_ || peer < 0 || peer >= size() || fds_[peer].get() < 0) return;
  const FrameHeader header{kFrameMagic, sequence, static_cast<uint64_t>(bytes)};
  std::vector<char> frame(sizeof(header) + static_cast<size_t>(bytes));
  std::memcpy(frame.data(), &header, sizeof(header));
  std::memcpy(frame.data() + sizeof(header), data, static_cast<size_t>(bytes));
  try {
    write_all(fds_[peer].get(), frame.data(), frame.size(), Clock::now() + std::chrono::seconds(1), "a partner");
  } catch (const std::exception&) {
  }
}

bool SocketLinks::crosses_long_paths() const {
  // By the measurement, whatever DDPKIT_LINK_SEND_BUFFER set the buffers to.
  for (const LinkPath& path : send_buffers_.paths()) {
    if (path.peer_rank >= 0 && choose_send_buffer(path.round_trip_us, path.bits_per_s) == SendBufferChoice::kLongPath) {
      return true;
    }
  }
  return false;
}

}  // namespace ddpkit::comm

// Shared-memory collectives for the ranks of one decode group on one host.
//
// A decode step does a dozen small collectives (the plan broadcast, two all-reduces of the
// hidden state per layer, the logits gather). Over gloo's TCP loopback each costs ~1 ms
// here (two syscalls, a socket wake-up and a thread hand-off per hop), which made a tp=2
// step four times slower than tp=1. Ranks of a group always share a host (the leader spawns
// its followers), so they can exchange through one mapped file instead: a rank writes its
// contribution to its slot, publishes a sequence number, and waits for every rank's; the
// wait spins briefly and then sleeps on a futex, so an idle or slower peer costs no CPU.
//
// Every collective is a full round (all ranks arrive before any reads), and the slots are
// double-buffered by the round's parity: a rank can be at most one round ahead of another,
// so it never overwrites a slot that a peer is still reading. Reductions sum in rank order,
// so every rank gets bit-identical results (their hidden states must not drift apart).

#include <fcntl.h>
#include <sched.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>

namespace {

constexpr uint32_t kMagic = 0x54504c41;  // "TPLA"
constexpr int kMaxRanks = 64;
// Waiting: a short spin (the peer usually arrives within microseconds when it has a core),
// then yields (on a host with more runnable processes than cores, a spinning rank would hold
// the core its peer needs), then a futex sleep.
constexpr int kSpins = 256;
constexpr int kYields = 64;

struct alignas(64) Arrival {
  std::atomic<uint64_t> round;
};

struct Header {
  uint32_t magic;
  uint32_t world;
  uint64_t slot_bytes;
  alignas(64) std::atomic<uint32_t> generation;  // futex word: bumped by every arrival
  alignas(64) std::atomic<int32_t> pids[kMaxRanks];
  Arrival arrived[kMaxRanks];
};

constexpr size_t kDataOffset = (sizeof(Header) + 4095) / 4096 * 4096;

struct Group {
  char* base;
  size_t bytes;
  Header* header;
  int rank, world;
  uint64_t slot_bytes;
  uint64_t round;
};

enum Status { kOk = 0, kTimeout = 1, kPeerDied = 2, kBadArgs = 3 };

inline void pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

// A zombie answers kill(pid, 0) too: a follower that died stays one until the leader, which
// may be the one waiting here, reaps it. So read its state.
bool alive(int32_t pid) {
  if (pid <= 0) return true;  // not attached yet
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return true;  // no /proc: trust kill()
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* close = std::strrchr(buf, ')');
  return close == nullptr || close[1] != ' ' || (close[2] != 'Z' && close[2] != 'X');
}

char* slot(Group* g, uint64_t round, int rank) {
  return g->base + kDataOffset + ((round & 1) * g->world + rank) * g->slot_bytes;
}

void arrive(Group* g) {
  g->header->arrived[g->rank].round.store(g->round, std::memory_order_release);
  g->header->generation.fetch_add(1, std::memory_order_acq_rel);
  futex(&g->header->generation, FUTEX_WAKE, INT32_MAX, nullptr);
}

bool all_arrived(Group* g) {
  for (int r = 0; r < g->world; ++r)
    if (g->header->arrived[r].round.load(std::memory_order_acquire) < g->round) return false;
  return true;
}

// Wait until every rank reached this round; a dead peer or the deadline ends the wait.
int wait_all(Group* g, double timeout_s) {
  for (int i = 0; i < kSpins; ++i) {
    if (all_arrived(g)) return kOk;
    pause();
  }
  for (int i = 0; i < kYields; ++i) {
    if (all_arrived(g)) return kOk;
    sched_yield();
  }
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  const timespec slice{0, 10 * 1000 * 1000};  // re-check peers every 10 ms
  while (true) {
    const uint32_t seen = g->header->generation.load(std::memory_order_acquire);
    if (all_arrived(g)) return kOk;
    futex(&g->header->generation, FUTEX_WAIT, seen, &slice);
    if (all_arrived(g)) return kOk;
    for (int r = 0; r < g->world; ++r)
      if (r != g->rank && g->header->arrived[r].round.load() < g->round &&
          !alive(g->header->pids[r].load()))
        return kPeerDied;
    if (std::chrono::steady_clock::now() > deadline) return kTimeout;
  }
}

// One round: copy `bytes` of `mine` into this rank's slot (if any), wait for every rank.
int round_trip(Group* g, const void* mine, uint64_t bytes, double timeout_s) {
  g->round += 1;
  if (mine != nullptr && bytes > 0) std::memcpy(slot(g, g->round, g->rank), mine, bytes);
  arrive(g);
  return wait_all(g, timeout_s);
}

}  // namespace

extern "C" {

// Map (and with `create`, make) the group's file. Returns a handle, or null with errno set.
void* tpla_shm_attach(const char* path, int rank, int world, uint64_t slot_bytes, int create) {
  if (world < 1 || world > kMaxRanks || rank < 0 || rank >= world || slot_bytes == 0) {
    errno = EINVAL;
    return nullptr;
  }
  slot_bytes = (slot_bytes + 63) / 64 * 64;
  const size_t bytes = kDataOffset + 2 * static_cast<size_t>(world) * slot_bytes;
  const int fd = open(path, create ? (O_RDWR | O_CREAT | O_EXCL) : O_RDWR, 0600);
  if (fd < 0) return nullptr;
  // Reserve the pages now: a tmpfs too small for the file (a container's /dev/shm is 64 MB by
  // default) must fail here, not with SIGBUS at the first write of a collective.
  if (create) {
    const int err = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
    if (err != 0) {
      close(fd);
      unlink(path);
      errno = err;
      return nullptr;
    }
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != bytes) {
    close(fd);
    errno = EINVAL;  // a file of another group layout
    return nullptr;
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) return nullptr;
  auto* header = static_cast<Header*>(base);
  if (create) {  // a fresh file is all zeros: rounds start at 0
    header->world = static_cast<uint32_t>(world);
    header->slot_bytes = slot_bytes;
    header->magic = kMagic;
  } else if (header->magic != kMagic || header->world != static_cast<uint32_t>(world) ||
             header->slot_bytes != slot_bytes) {
    munmap(base, bytes);
    errno = EINVAL;
    return nullptr;
  }
  header->pids[rank].store(static_cast<int32_t>(getpid()));
  return new Group{static_cast<char*>(base), bytes, header, rank, world, slot_bytes, 0};
}

void tpla_shm_detach(void* handle) {
  auto* g = static_cast<Group*>(handle);
  munmap(g->base, g->bytes);
  delete g;
}

// In-place all-reduce of n floats: op 0 = sum, 1 = max.
int tpla_shm_all_reduce(void* handle, float* data, int64_t n, int op, double timeout_s) {
  auto* g = static_cast<Group*>(handle);
  const int64_t per_round = static_cast<int64_t>(g->slot_bytes / sizeof(float));
  for (int64_t start = 0; start < n; start += per_round) {
    const int64_t count = std::min(per_round, n - start);
    float* mine = data + start;
    const int status = round_trip(g, mine, count * sizeof(float), timeout_s);
    if (status != kOk) return status;
    // Rank order, identical on every rank.
    const float* first = reinterpret_cast<const float*>(slot(g, g->round, 0));
    std::memcpy(mine, first, count * sizeof(float));
    for (int r = 1; r < g->world; ++r) {
      const float* other = reinterpret_cast<const float*>(slot(g, g->round, r));
      if (op == 0)
        for (int64_t i = 0; i < count; ++i) mine[i] += other[i];
      else
        for (int64_t i = 0; i < count; ++i) mine[i] = std::max(mine[i], other[i]);
    }
  }
  return kOk;
}

// Every rank ends with `root`'s bytes.
int tpla_shm_broadcast(void* handle, void* data, int64_t bytes, int root, double timeout_s) {
  auto* g = static_cast<Group*>(handle);
  if (root < 0 || root >= g->world) return kBadArgs;
  auto* p = static_cast<char*>(data);
  const int64_t per_round = static_cast<int64_t>(g->slot_bytes);
  for (int64_t start = 0; start < bytes; start += per_round) {
    const int64_t count = std::min(per_round, bytes - start);
    const int status = round_trip(g, g->rank == root ? p + start : nullptr, count, timeout_s);
    if (status != kOk) return status;
    if (g->rank != root) std::memcpy(p + start, slot(g, g->round, root), count);
  }
  return kOk;
}

// out = every rank's `bytes` of input, in rank order (world * bytes), on every rank, or with
// root >= 0 on `root` only (a gather: the others copy nothing out, and `out` may be null
// there; a step's logits are large for a big vocabulary, and only the leader samples).
int tpla_shm_all_gather(void* handle, const void* in, int64_t bytes, void* out, int root,
                        double timeout_s) {
  auto* g = static_cast<Group*>(handle);
  if (root >= g->world) return kBadArgs;
  const auto* src = static_cast<const char*>(in);
  auto* dst = static_cast<char*>(out);
  const bool keep = root < 0 || root == g->rank;
  const int64_t per_round = static_cast<int64_t>(g->slot_bytes);
  for (int64_t start = 0; start < bytes; start += per_round) {
    const int64_t count = std::min(per_round, bytes - start);
    const int status = round_trip(g, src + start, count, timeout_s);
    if (status != kOk) return status;
    if (keep)
      for (int r = 0; r < g->world; ++r)
        std::memcpy(dst + r * bytes + start, slot(g, g->round, r), count);
  }
  return kOk;
}

}  // extern "C"

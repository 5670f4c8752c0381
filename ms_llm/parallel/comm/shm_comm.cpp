// Collectives among the processes of one host through a shared-memory segment (called through
// ctypes by ms_llm/parallel/comm/shm.py; ctypes releases the GIL for the whole call).
//
// Why: MindSpore 2.10's CPU collectives (mccl, over TCP) move 0.1-0.2 GB/s on the 2-core
// development VMs: a 64 MiB all_reduce took ~1 s against ~66 ms for torch's gloo. Workers of one
// msrun job on one host can instead copy through memory they share.
//
// Segment layout (made by shm.py, the same on every rank):
//   [0, 64 * (1 + world))        header: one 64-byte line per rank holding its barrier counter
//   [data, data + world * slot)  one slot per rank (what it contributes to the current chunk)
//   [res, res + slot)            the reduced chunk (all_reduce)
// A large operation runs in chunks that fit a slot. Between the phases of a chunk every rank
// passes a barrier: it publishes its counter (release store, single writer per line) and waits
// until every peer's counter has reached the same value (acquire loads), spinning briefly, then
// sleeping on a futex. Every rank calls the same collectives in the same order, so the
// counters advance in lockstep; `seq` is this rank's counter, kept by the caller.
//
// Reductions are done in rank order (0, 1, ..., W-1) for every element, so every rank gets the
// same bits and repeated runs give the same bits (the deterministic mode's requirement); bf16 is
// accumulated in fp32 and rounded once (round to nearest even).
//
// Return codes: 0 ok, 1 a peer did not arrive within the time-out, 2 unsupported dtype / op.

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <climits>
#include <cstdint>
#include <cstring>

#define MSLLM_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

constexpr int64_t kLine = 64;

enum Dtype { kF32 = 0, kF64 = 1, kBF16 = 2, kI32 = 3, kI64 = 4 };
enum Op { kSum = 0, kMax = 1, kMin = 2, kProd = 3 };

struct Ctx {
  char *base;
  int64_t world, rank, slot;
  uint64_t *seq;
  double timeout;

  uint32_t *line(int64_t r) const { return reinterpret_cast<uint32_t *>(base + kLine * (1 + r)); }
  char *data() const {
    const int64_t head = kLine * (1 + world);
    return base + ((head + 4095) / 4096) * 4096;
  }
  char *slot_of(int64_t r) const { return data() + r * slot; }
  char *result() const { return data() + world * slot; }
};

double now() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

inline void pause_cpu() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

int futex(uint32_t *addr, int op, uint32_t val, const timespec *ts) {
  return static_cast<int>(syscall(SYS_futex, addr, op, val, ts, nullptr, 0));
}

// Every rank arrives; returns false on time-out. A rank publishes its counter and wakes whoever
// sleeps on it; a waiter spins a little (a peer that is already there costs nothing), then sleeps
// on the peer's counter with a shared (not process-private) futex, so waiting ranks give their
// core to the ones still computing (several jobs share the 2-core machines) and wake at once.
bool barrier(const Ctx &c) {
  const uint32_t target = static_cast<uint32_t>(++*c.seq);
  uint32_t *mine = c.line(c.rank);
  __atomic_store_n(mine, target, __ATOMIC_RELEASE);
  futex(mine, FUTEX_WAKE, INT32_MAX, nullptr);
  double start = -1.0;
  for (int64_t r = 0; r < c.world; ++r) {
    if (r == c.rank) continue;
    uint32_t *flag = c.line(r);
    int spins = 0;
    for (;;) {
      const uint32_t v = __atomic_load_n(flag, __ATOMIC_ACQUIRE);
      if (static_cast<int32_t>(v - target) >= 0) break;
      if (++spins < 200) {
        pause_cpu();
        continue;
      }
      timespec ts{0, 100000000};   // 100 ms, then look at the clock
      futex(flag, FUTEX_WAIT, v, &ts);
      const double t = now();
      if (start < 0) start = t;
      else if (t - start > c.timeout) return false;
    }
  }
  return true;
}

inline float bf16_to_f32(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

template <typename T>
inline T combine(T a, T b, int op) {
  switch (op) {
    case kSum: return a + b;
    case kMax: return a > b ? a : b;
    case kMin: return a < b ? a : b;
    default: return a * b;
  }
}

// out[i] = src[0][i] op src[1][i] op ... in rank order, elements [0, n).
template <typename T>
void reduce_typed(const char *const *src, int64_t w, char *out, int64_t n, int op) {
  T *o = reinterpret_cast<T *>(out);
  const T *s0 = reinterpret_cast<const T *>(src[0]);
  for (int64_t i = 0; i < n; ++i) o[i] = s0[i];
  for (int64_t r = 1; r < w; ++r) {
    const T *s = reinterpret_cast<const T *>(src[r]);
    if (op == kSum) {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] += s[i];
    } else {
      for (int64_t i = 0; i < n; ++i) o[i] = combine(o[i], s[i], op);
    }
  }
}

void reduce_bf16(const char *const *src, int64_t w, char *out, int64_t n, int op) {
  constexpr int64_t kBlock = 1024;
  float acc[kBlock];
  uint16_t *o = reinterpret_cast<uint16_t *>(out);
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t m = n - b < kBlock ? n - b : kBlock;
    const uint16_t *s0 = reinterpret_cast<const uint16_t *>(src[0]) + b;
    for (int64_t i = 0; i < m; ++i) acc[i] = bf16_to_f32(s0[i]);
    for (int64_t r = 1; r < w; ++r) {
      const uint16_t *s = reinterpret_cast<const uint16_t *>(src[r]) + b;
      for (int64_t i = 0; i < m; ++i) acc[i] = combine(acc[i], bf16_to_f32(s[i]), op);
    }
    for (int64_t i = 0; i < m; ++i) o[b + i] = f32_to_bf16(acc[i]);
  }
}

int64_t elem_size(int dtype) {
  switch (dtype) {
    case kF32: case kI32: return 4;
    case kF64: case kI64: return 8;
    case kBF16: return 2;
    default: return 0;
  }
}

bool reduce(const char *const *src, int64_t w, char *out, int64_t n, int dtype, int op) {
  if (op < kSum || op > kProd) return false;
  switch (dtype) {
    case kF32: reduce_typed<float>(src, w, out, n, op); return true;
    case kF64: reduce_typed<double>(src, w, out, n, op); return true;
    case kI32: reduce_typed<int32_t>(src, w, out, n, op); return true;
    case kI64: reduce_typed<int64_t>(src, w, out, n, op); return true;
    case kBF16: reduce_bf16(src, w, out, n, op); return true;
    default: return false;
  }
}

// Elements [lo, hi) of a piece of `n` split over `w` ranks as evenly as possible, part `r`.
void split(int64_t n, int64_t w, int64_t r, int64_t *lo, int64_t *hi) {
  const int64_t q = n / w, rem = n % w;
  *lo = r * q + (r < rem ? r : rem);
  *hi = *lo + q + (r < rem ? 1 : 0);
}

Ctx make(void *base, int64_t world, int64_t rank, int64_t slot, uint64_t *seq, double timeout) {
  return Ctx{static_cast<char *>(base), world, rank, slot, seq, timeout};
}

}  // namespace

MSLLM_EXPORT int64_t MsLlmShmAbiVersion() { return 1; }

// The byte offset of slot 0 (the header's size rounded to a page) for a `world`-rank segment.
MSLLM_EXPORT int64_t MsLlmShmDataOffset(int64_t world) {
  const int64_t head = kLine * (1 + world);
  return ((head + 4095) / 4096) * 4096;
}

MSLLM_EXPORT int MsLlmShmBarrier(void *base, int64_t world, int64_t rank, int64_t slot,
                                 uint64_t *seq, double timeout) {
  const Ctx c = make(base, world, rank, slot, seq, timeout);
  return barrier(c) ? 0 : 1;
}

// In place or not: out = in_0 op in_1 op ... over the ranks, `count` elements.
MSLLM_EXPORT int MsLlmShmAllReduce(void *base, int64_t world, int64_t rank, int64_t slot,
                                   uint64_t *seq, double timeout, const void *in, void *out,
                                   int64_t count, int dtype, int op) {
  const Ctx c = make(base, world, rank, slot, seq, timeout);
  const int64_t es = elem_size(dtype);
  if (es == 0 || op < kSum || op > kProd) return 2;
  const int64_t per_chunk = slot / es;
  const char *src = static_cast<const char *>(in);
  char *dst = static_cast<char *>(out);
  const char *slots[256];
  for (int64_t off = 0; off < count; off += per_chunk) {
    const int64_t n = count - off < per_chunk ? count - off : per_chunk;
    std::memcpy(c.slot_of(rank), src + off * es, n * es);
    if (!barrier(c)) return 1;
    int64_t lo, hi;
    split(n, world, rank, &lo, &hi);
    for (int64_t r = 0; r < world; ++r) slots[r] = c.slot_of(r) + lo * es;
    if (hi > lo) reduce(slots, world, c.result() + lo * es, hi - lo, dtype, op);
    if (!barrier(c)) return 1;
    std::memcpy(dst + off * es, c.result(), n * es);
    if (!barrier(c)) return 1;
  }
  return 0;
}

// outs[r] (a pointer per rank, `nbytes` each) = rank r's `in`.
MSLLM_EXPORT int MsLlmShmAllGather(void *base, int64_t world, int64_t rank, int64_t slot,
                                   uint64_t *seq, double timeout, const void *in,
                                   void *const *outs, int64_t nbytes) {
  const Ctx c = make(base, world, rank, slot, seq, timeout);
  const char *src = static_cast<const char *>(in);
  for (int64_t off = 0; off < nbytes; off += slot) {
    const int64_t n = nbytes - off < slot ? nbytes - off : slot;
    std::memcpy(c.slot_of(rank), src + off, n);
    if (!barrier(c)) return 1;
    for (int64_t r = 0; r < world; ++r)
      std::memcpy(static_cast<char *>(outs[r]) + off, c.slot_of(r), n);
    if (!barrier(c)) return 1;
  }
  return 0;
}

// out (`count` elements) = the rank-order reduction of every rank's in[rank * count, +count).
MSLLM_EXPORT int MsLlmShmReduceScatter(void *base, int64_t world, int64_t rank, int64_t slot,
                                       uint64_t *seq, double timeout, const void *in, void *out,
                                       int64_t count, int dtype, int op) {
  const Ctx c = make(base, world, rank, slot, seq, timeout);
  const int64_t es = elem_size(dtype);
  if (es == 0 || op < kSum || op > kProd) return 2;
  const int64_t per_chunk = slot / (es * world);    // elements of each destination per round
  if (per_chunk < 1) return 2;
  const char *src = static_cast<const char *>(in);
  char *dst = static_cast<char *>(out);
  const char *slots[256];
  for (int64_t off = 0; off < count; off += per_chunk) {
    const int64_t n = count - off < per_chunk ? count - off : per_chunk;
    for (int64_t j = 0; j < world; ++j)
      std::memcpy(c.slot_of(rank) + j * n * es, src + (j * count + off) * es, n * es);
    if (!barrier(c)) return 1;
    for (int64_t r = 0; r < world; ++r) slots[r] = c.slot_of(r) + rank * n * es;
    reduce(slots, world, dst + off * es, n, dtype, op);
    if (!barrier(c)) return 1;
  }
  return 0;
}

// buf (`nbytes`) = root's buf.
MSLLM_EXPORT int MsLlmShmBroadcast(void *base, int64_t world, int64_t rank, int64_t slot,
                                   uint64_t *seq, double timeout, void *buf, int64_t nbytes,
                                   int64_t root) {
  const Ctx c = make(base, world, rank, slot, seq, timeout);
  char *p = static_cast<char *>(buf);
  for (int64_t off = 0; off < nbytes; off += slot) {
    const int64_t n = nbytes - off < slot ? nbytes - off : slot;
    if (rank == root) std::memcpy(c.slot_of(root), p + off, n);
    if (!barrier(c)) return 1;
    if (rank != root) std::memcpy(p + off, c.slot_of(root), n);
    if (!barrier(c)) return 1;
  }
  return 0;
}

// Rank i sends send[j] bytes at in + send_off[j] to rank j, which receives them at
// out + recv_off[i] (recv[i] bytes, equal to what i sends it). `rounds`: the largest pair's byte
// count over the per-pair room of a slot, the same on every rank (the caller computes it from the
// whole split matrix).
MSLLM_EXPORT int MsLlmShmAllToAllV(void *base, int64_t world, int64_t rank, int64_t slot,
                                   uint64_t *seq, double timeout, const void *in,
                                   const int64_t *send, const int64_t *send_off, void *out,
                                   const int64_t *recv, const int64_t *recv_off, int64_t rounds) {
  const Ctx c = make(base, world, rank, slot, seq, timeout);
  const int64_t room = slot / world;
  const char *src = static_cast<const char *>(in);
  char *dst = static_cast<char *>(out);
  for (int64_t k = 0; k < rounds; ++k) {
    const int64_t off = k * room;
    for (int64_t j = 0; j < world; ++j) {
      const int64_t n = send[j] - off;
      if (n > 0) std::memcpy(c.slot_of(rank) + j * room, src + send_off[j] + off, n < room ? n : room);
    }
    if (!barrier(c)) return 1;
    for (int64_t i = 0; i < world; ++i) {
      const int64_t n = recv[i] - off;
      if (n > 0) std::memcpy(dst + recv_off[i] + off, c.slot_of(i) + rank * room, n < room ? n : room);
    }
    if (!barrier(c)) return 1;
  }
  return 0;
}

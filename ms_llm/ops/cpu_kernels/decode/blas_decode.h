// The one-token decode step's parts, shared by the per-layer AOT calls (blas_decode.cpp) and the
// whole-model step (blas_decode_model.cpp): RMSNorm, rotate-half RoPE, the weight products (split
// over threads when large), a layer's attention half with the in-place cache write, its SwiGLU MLP
// half. fp32 throughout; they compute what ms_llm.models.layers computes (tested against it).
//
// Threads: nt > 1 splits a large weight product over its output rows and the attention over its
// (batch row, query group) pairs on std::threads, each running single-threaded OpenBLAS calls
// (the caller keeps OpenBLAS at one thread during decoding, see ms_llm.inference.generate); small
// products stay on the calling thread, where a thread start would cost more than it saves.
#pragma once

#include <cblas.h>

#include <cmath>
#include <cstdint>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "cpu_math.h"

namespace msllm_decode {

using msllm::exp_f;

// Below this many multiply-adds a product runs on the calling thread (~0.1 ms of one core).
constexpr int64_t kParallelMacs = int64_t(1) << 20;

// Threads for a step: nt, and the work (multiply-adds) below which a part stays on this thread.
struct Par {
  int nt = 1;
  int64_t min_macs = kParallelMacs;
};

// A process-wide pool of helper threads for the decode step, created on first use and kept
// (never destroyed: threads outliving static destruction must not be joined). run(n, nt, body)
// calls body(c) for every chunk c in [0, n) on this thread and up to nt - 1 helpers; chunks are
// taken one at a time from a shared counter, so a helper the OS does not schedule (a loaded
// machine) costs nothing: this thread takes its chunks, and only waits for chunks in progress.
// Helpers block on a condition variable between steps (no spinning on a shared core).
class Pool {
 public:
  static Pool &get() {
    static Pool *pool = new Pool();
    return *pool;
  }

  template <typename Body>
  void run(int64_t n, int nt, Body &&body) {
    if (nt < 2 || n < 2) {
      for (int64_t c = 0; c < n; ++c) body(c);
      return;
    }
    std::lock_guard<std::mutex> one_at_a_time(run_mu_);
    auto job = std::make_shared<Job>();
    job->fn = body;
    job->total = n;
    {
      std::lock_guard<std::mutex> lk(mu_);
      while (static_cast<int>(workers_.size()) < nt - 1) {
        const int id = static_cast<int>(workers_.size());
        workers_.emplace_back([this, id] { loop(id); });
      }
      job_ = job;
      active_ = nt - 1;
      ++gen_;
    }
    cv_.notify_all();
    work(*job);
    while (job->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
  }

 private:
  // One run's chunks: a helper that picks it up late finds none left and never calls fn.
  struct Job {
    std::function<void(int64_t)> fn;
    std::atomic<int64_t> next{0}, done{0};
    int64_t total = 0;
  };

  static void work(Job &job) {
    for (;;) {
      const int64_t c = job.next.fetch_add(1);
      if (c >= job.total) return;
      job.fn(c);
      job.done.fetch_add(1, std::memory_order_release);
    }
  }

  void loop(int id) {
    uint64_t seen = 0;
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return gen_ != seen; });
        seen = gen_;
        if (id >= active_) continue;
        job = job_;
      }
      work(*job);
    }
  }

  std::mutex run_mu_, mu_;
  std::condition_variable cv_;
  std::vector<std::thread> workers_;
  std::shared_ptr<Job> job_;
  int active_ = 0;
  uint64_t gen_ = 0;
};

// y [m, n] (row stride ldy) = x [m, k] w[n, k]^T (+ bias [n]), on this thread.
inline void gemm_wt(const float *x, const float *w, const float *bias, float *y, int64_t m, int64_t n, int64_t k,
                    int64_t ldy) {
  if (n <= 0) return;
  if (m == 1) {
    scipy_cblas_sgemv(CblasRowMajor, CblasNoTrans, static_cast<blasint>(n), static_cast<blasint>(k), 1.0f, w,
                      static_cast<blasint>(k), x, 1, 0.0f, y, 1);
  } else {
    scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(m), static_cast<blasint>(n),
                      static_cast<blasint>(k), 1.0f, x, static_cast<blasint>(k), w, static_cast<blasint>(k), 0.0f, y,
                      static_cast<blasint>(ldy));
  }
  if (bias != nullptr)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) y[i * ldy + j] += bias[j];
}

// y [m, n] = x [m, k] w[n, k]^T (+ bias), the output rows of w split over nt threads when large.
inline void matmul_wt(const float *x, const float *w, const float *bias, float *y, int64_t m, int64_t n, int64_t k,
                      const Par &par = Par()) {
  if (par.nt < 2 || m * n * k < par.min_macs) {
    gemm_wt(x, w, bias, y, m, n, k, n);
    return;
  }
  // chunks of >= ~256K multiply-adds, in rows of 16 (the kernels' vector width)
  int64_t rows = ((int64_t(1) << 18) / (m * k) + 15) / 16 * 16;
  rows = rows < 16 ? 16 : rows;
  const int64_t chunks = (n + rows - 1) / rows;
  Pool::get().run(chunks, par.nt, [=](int64_t c) {
    const int64_t n0 = c * rows, n1 = n0 + rows < n ? n0 + rows : n;
    gemm_wt(x, w + n0 * k, bias ? bias + n0 : nullptr, y + n0, m, n1 - n0, k, n);
  });
}

// y = x * rsqrt(mean(x^2) + eps) * (w + offset), fp32 statistics as ops/rms_norm.py.
inline void rms_norm(const float *x, const float *w, float offset, float eps, float *y, int64_t n) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * inv * (w[i] + offset);
}

// Rotate-half RoPE of the first rot (<= 1024) dims of v in place (the rest passes through).
inline void rope(float *v, const float *cos, const float *sin, int64_t rot) {
  const int64_t half = rot / 2;
  float tmp[1024];
  for (int64_t j = 0; j < rot; ++j) {
    const float rh = j < half ? -v[j + half] : v[j - half];
    tmp[j] = v[j] * cos[j] + rh * sin[j];
  }
  std::memcpy(v, tmp, sizeof(float) * rot);
}

// One layer's attention half for one new token per batch row. Absent optional weights are null.
struct AttnLayer {
  const float *w_norm, *w_qkv, *b_qkv, *q_norm, *k_norm, *w_proj, *b_proj;
  int64_t r, g, d, rot;  // query heads per group, groups, head dim, rotated dims
  bool gated;            // Qwen3-Next output gate rows [q | gate | k | v] per group
  float offset, eps, scale;
};

// What changes per token: the rows' cos / sin (row i at cos + i * cs_stride), which slots each row
// must not see (row i's flags at hidden + i * hidden_stride, True = hidden; slots past pos are
// never read), the cache buffers [b, g, cap, d] and the slot written.
struct AttnStep {
  const float *cos, *sin;
  int64_t cs_stride;
  const bool *hidden;
  int64_t hidden_stride;
  float *k_cache, *v_cache;
  int64_t cap, pos;
  double *core_seconds = nullptr;  // if set, += the time of the attention over the cache
};

inline double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// out [b, h] = x + proj(attention(rope(qk_norm(split(qkv(rms_norm(x))))))); K/V written at slot pos.
inline void attn_block(const AttnLayer &L, const AttnStep &S, const float *x, float *out, int64_t b, int64_t h,
                       const Par &par) {
  const int64_t r = L.r, g = L.g, d = L.d, rq = L.gated ? 2 * r : r, width = g * (rq + 2) * d, nh = g * r;
  const int64_t kmax = S.pos + 1, cap = S.cap, pos = S.pos;
  std::vector<float> xn(b * h), qkv(b * width), attn(b * nh * d);
  for (int64_t i = 0; i < b; ++i) rms_norm(x + i * h, L.w_norm, L.offset, L.eps, xn.data() + i * h, h);
  matmul_wt(xn.data(), L.w_qkv, L.b_qkv, qkv.data(), b, width, h, par);
  auto job = [&](int64_t jg) {
    thread_local std::vector<float> scores;
    scores.resize(r * kmax);
    {
      const int64_t i = jg / g, gi = jg % g;
      const float *ci = S.cos + i * S.cs_stride, *si = S.sin + i * S.cs_stride;
      const bool *mi = S.hidden + i * S.hidden_stride;
      float *row = qkv.data() + i * width + gi * (rq + 2) * d;
      float *q = row, *gate = row + r * d, *k = row + rq * d, *v = k + d;
      for (int64_t hq = 0; hq < r; ++hq) {
        if (L.q_norm) rms_norm(q + hq * d, L.q_norm, L.offset, L.eps, q + hq * d, d);
        rope(q + hq * d, ci, si, L.rot);
      }
      if (L.k_norm) rms_norm(k, L.k_norm, L.offset, L.eps, k, d);
      rope(k, ci, si, L.rot);
      float *kg = S.k_cache + (i * g + gi) * cap * d, *vg = S.v_cache + (i * g + gi) * cap * d;
      std::memcpy(kg + pos * d, k, sizeof(float) * d);
      std::memcpy(vg + pos * d, v, sizeof(float) * d);
      // scores [r, kmax] = q [r, d] K[:kmax]^T over the visible slots; softmax; o [r, d] = P V.
      // Direct loops, not OpenBLAS: with r (a few) rows a GEMM spends more packing K and V than
      // multiplying; here each visible key and value row is read once for the r heads.
      float *sc = scores.data();
      float hi[64];
      for (int64_t hq = 0; hq < r; ++hq) hi[hq] = -INFINITY;
      for (int64_t j = 0; j < kmax; ++j) {
        if (mi[j]) continue;
        const float *kj = kg + j * d;
        for (int64_t hq = 0; hq < r; ++hq) {
          const float *qh = q + hq * d;
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t t = 0; t < d; ++t) acc += qh[t] * kj[t];
          acc *= L.scale;
          sc[hq * kmax + j] = acc;
          if (acc > hi[hq]) hi[hq] = acc;
        }
      }
      float *o = attn.data() + (i * nh + gi * r) * d;
      std::memset(o, 0, sizeof(float) * r * d);
      for (int64_t hq = 0; hq < r; ++hq) {
        float *sr = sc + hq * kmax;
        float sum = 0.f;
        for (int64_t j = 0; j < kmax; ++j) {
          const float e = mi[j] ? 0.f : exp_f(sr[j] - hi[hq]);
          sr[j] = e;
          sum += e;
        }
        const float inv = sum > 0.f ? 1.0f / sum : 0.f;  // every slot hidden: zeros
        for (int64_t j = 0; j < kmax; ++j) sr[j] *= inv;
      }
      for (int64_t j = 0; j < kmax; ++j) {
        if (mi[j]) continue;
        const float *vj = vg + j * d;
        for (int64_t hq = 0; hq < r; ++hq) {
          const float pj = sc[hq * kmax + j];
          float *oh = o + hq * d;
#pragma omp simd
          for (int64_t t = 0; t < d; ++t) oh[t] += pj * vj[t];
        }
      }
      if (L.gated)
        for (int64_t j = 0; j < r * d; ++j) o[j] *= 1.0f / (1.0f + std::exp(-gate[j]));
    }
  };
  const double t0 = S.core_seconds ? now_seconds() : 0.0;
  // (row, group) pairs are independent (each writes its own cache rows and output heads)
  Pool::get().run(b * g, par.nt > 1 && b * g * r * kmax * d * 2 >= par.min_macs ? par.nt : 1, job);
  if (S.core_seconds) *S.core_seconds += now_seconds() - t0;
  matmul_wt(attn.data(), L.w_proj, L.b_proj, out, b, h, nh * d, par);
  for (int64_t j = 0; j < b * h; ++j) out[j] += x[j];
}

// One layer's SwiGLU MLP half: fc1 [2F, H] holds [gate; up], fc2 [H, F].
struct MlpLayer {
  const float *w_norm, *w_fc1, *b_fc1, *w_fc2, *b_fc2;
  int64_t f;
  float offset, eps;
};

// out [m, h] = x + fc2(swiglu(fc1(rms_norm(x)))).
inline void mlp_block(const MlpLayer &L, const float *x, float *out, int64_t m, int64_t h, const Par &par) {
  const int64_t f = L.f, f2 = 2 * f;
  std::vector<float> xn(m * h), hid(m * f2), act(m * f);
  for (int64_t i = 0; i < m; ++i) rms_norm(x + i * h, L.w_norm, L.offset, L.eps, xn.data() + i * h, h);
  matmul_wt(xn.data(), L.w_fc1, L.b_fc1, hid.data(), m, f2, h, par);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < f; ++j) {
      const float gv = hid[i * f2 + j];
      act[i * f + j] = gv / (1.0f + std::exp(-gv)) * hid[i * f2 + f + j];
    }
  matmul_wt(act.data(), L.w_fc2, L.b_fc2, out, m, h, f, par);
  for (int64_t j = 0; j < m * h; ++j) out[j] += x[j];
}

}  // namespace msllm_decode

// Fused fp32 CPU kernels for ms-llm, called by MindSpore through ops.Custom(func_type="aot").
//
// Every exported function has the MindSpore AOT signature
//   extern "C" int Fn(int nparam, void **params, int *ndims, int64_t **shapes,
//                     const char **dtypes, void *stream, void *extra)
// with the inputs first and then the outputs in `params`. A non-zero return value makes MindSpore
// raise. Python scalars passed to the op arrive as 0-d tensors (float -> "float32", int -> "int64").
//
// Built by build.py with `g++ -O3 -march=native -fopenmp -shared -fPIC` (see build.py). No MindSpore headers are
// needed. All kernels are fp32 only; the Python wrappers upcast fp16/bf16 inputs.
//
// Threading: single-threaded by default. MS_LLM_AOT_THREADS=n (n > 1) splits rows over n OpenMP
// threads for calls with at least kMinParallelWork elements. Measured on the 2-vCPU development VM
// (a nested VM where waking the other vCPU is slow): with 2 threads, rms_norm/swiglu at the model
// shapes ran 1.7-1.9x faster when the other vCPU was idle, but took a flat ~8 ms (vs 0.2-2 ms) when
// it was busy; cross entropy at 2048 x 32000 ranged from 1.5x faster to 1.3x slower. A training step
// keeps both vCPUs busy (MindSpore's matmuls use 2 threads), so the default is 1 thread.
// Vectorisation comes from `#pragma omp simd` (-fopenmp, or -fopenmp-simd in the no-OpenMP build).

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>
#include "cpu_math.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#define MSLLM_EXPORT extern "C" __attribute__((visibility("default")))

using namespace msllm;

namespace {

// A call is split across threads only if it touches at least this many elements.
constexpr int64_t kMinParallelWork = 1 << 20;

int max_threads() {
#ifdef _OPENMP
  static const int n = [] {
    const char *env = std::getenv("MS_LLM_AOT_THREADS");
    int v = env ? std::atoi(env) : 1;
    const int procs = omp_get_num_procs();
    if (v > procs) v = procs;
    if (v < 1) v = 1;
    return v;
  }();
  return n;
#else
  return 1;
#endif
}

int threads_for(int64_t work, int64_t rows) {
  if (work < kMinParallelWork) return 1;
  int t = max_threads();
  if (rows < t) t = static_cast<int>(rows < 1 ? 1 : rows);
  return t;
}

inline float sigmoid_f(float a) { return 1.0f / (1.0f + exp_f(-a)); }

template <class T>
float row_sum_sq(const T *x, int64_t h) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < h; ++j) s += to_f32(x[j]) * to_f32(x[j]);
  return s;
}

template <class T>
float row_max(const T *x, int64_t n) {
  float m = -INFINITY;
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < n; ++j) m = to_f32(x[j]) > m ? to_f32(x[j]) : m;
  return m;
}

// sum_j exp(scale * x_j - m)
template <class T>
float row_sum_exp(const T *x, int64_t n, float scale, float m) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < n; ++j) s += exp_f(scale * to_f32(x[j]) - m);
  return s;
}

}  // namespace

// --------------------------------------------------------------------------------------------
// Library identity, used by build.py to check that a cached .so loads and matches.
MSLLM_EXPORT int MsLlmKernelsAbiVersion() { return 1; }

MSLLM_EXPORT int MsLlmKernelsOpenMP() {
#ifdef _OPENMP
  return max_threads();
#else
  return 0;
#endif
}

// --------------------------------------------------------------------------------------------
// RMSNorm.  inputs: x [..., H] f32, w [H] f32, eps scalar.  output: y [..., H] f32.
//   y = x * rsqrt(mean(x^2, -1) + eps) * w
template <class T>
int rms_norm_fwd(void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  if (ndims[0] < 1) return kErrShape;
  const int64_t h = shapes[0][ndims[0] - 1];
  if (numel(ndims[1], shapes[1]) != h || numel(ndims[3], shapes[3]) != numel(ndims[0], shapes[0]))
    return kErrShape;
  double eps_d;
  if (!read_scalar(params[2], dtypes[2], &eps_d)) return kErrDtype;
  const float eps = static_cast<float>(eps_d);
  const T *x = static_cast<const T *>(params[0]);
  const T *w = static_cast<const T *>(params[1]);
  T *y = static_cast<T *>(params[3]);
  const int64_t rows = h > 0 ? numel(ndims[0], shapes[0]) / h : 0;
  const float inv_h = 1.0f / static_cast<float>(h);
  const int nt = threads_for(rows * h, rows);
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
  for (int64_t i = 0; i < rows; ++i) {
    const T *xr = x + i * h;
    T *yr = y + i * h;
    const float r = 1.0f / std::sqrt(row_sum_sq(xr, h) * inv_h + eps);
#pragma omp simd
    for (int64_t j = 0; j < h; ++j) yr[j] = from_f32<T>(to_f32(xr[j]) * r * to_f32(w[j]));
  }
  return 0;
}

MSLLM_EXPORT int RmsNormFwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                            void *, void *) {
  if (nparam != 4) return kErrNParam;
  const int kind = storage_kind(dtypes, {0, 1, 3});
  if (kind < 0) return kErrDtype;
  return kind ? rms_norm_fwd<uint16_t>(params, ndims, shapes, dtypes)
              : rms_norm_fwd<float>(params, ndims, shapes, dtypes);
}

// RMSNorm backward.  inputs: x [..., H], w [H], dy [..., H], eps.  outputs: dx [..., H], dw [H].
//   r = rsqrt(mean(x^2) + eps);  dx = r * dy * w - x * r^3 * sum(dy * w * x) / H;  dw = sum_rows(dy * x * r)
template <class T>
int rms_norm_bwd(void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  if (ndims[0] < 1) return kErrShape;
  const int64_t h = shapes[0][ndims[0] - 1];
  const int64_t total = numel(ndims[0], shapes[0]);
  if (numel(ndims[1], shapes[1]) != h || numel(ndims[2], shapes[2]) != total ||
      numel(ndims[4], shapes[4]) != total || numel(ndims[5], shapes[5]) != h)
    return kErrShape;
  double eps_d;
  if (!read_scalar(params[3], dtypes[3], &eps_d)) return kErrDtype;
  const float eps = static_cast<float>(eps_d);
  const T *x = static_cast<const T *>(params[0]);
  const T *w = static_cast<const T *>(params[1]);
  const T *dy = static_cast<const T *>(params[2]);
  T *dx = static_cast<T *>(params[4]);
  T *dw = static_cast<T *>(params[5]);
  const int64_t rows = h > 0 ? total / h : 0;
  const float inv_h = 1.0f / static_cast<float>(h);
  const int nt = threads_for(total, rows);
  // Per-thread partial dw, summed in thread order afterwards (deterministic for a fixed thread count).
  std::vector<float> partial(static_cast<size_t>(nt) * h, 0.0f);
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
#ifdef _OPENMP
    const int tid = omp_get_thread_num();
#else
    const int tid = 0;
#endif
    float *dwp = partial.data() + static_cast<size_t>(tid) * h;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < rows; ++i) {
      const T *xr = x + i * h;
      const T *gr = dy + i * h;
      T *dxr = dx + i * h;
      float ss = 0.f, dot = 0.f;
#pragma omp simd reduction(+ : ss, dot)
      for (int64_t j = 0; j < h; ++j) {
        const float xj = to_f32(xr[j]);
        ss += xj * xj;
        dot += to_f32(gr[j]) * to_f32(w[j]) * xj;
      }
      const float r = 1.0f / std::sqrt(ss * inv_h + eps);
      const float c = r * r * r * dot * inv_h;
#pragma omp simd
      for (int64_t j = 0; j < h; ++j) {
        const float xj = to_f32(xr[j]), gj = to_f32(gr[j]);
        dxr[j] = from_f32<T>(r * gj * to_f32(w[j]) - c * xj);
        dwp[j] += gj * xj * r;
      }
    }
  }
  for (int t = 1; t < nt; ++t) {
    const float *p = partial.data() + static_cast<size_t>(t) * h;
#pragma omp simd
    for (int64_t j = 0; j < h; ++j) partial[j] += p[j];
  }
  for (int64_t j = 0; j < h; ++j) dw[j] = from_f32<T>(partial[j]);
  return 0;
}

MSLLM_EXPORT int RmsNormBwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                            void *, void *) {
  if (nparam != 6) return kErrNParam;
  const int kind = storage_kind(dtypes, {0, 1, 2, 4, 5});
  if (kind < 0) return kErrDtype;
  return kind ? rms_norm_bwd<uint16_t>(params, ndims, shapes, dtypes)
              : rms_norm_bwd<float>(params, ndims, shapes, dtypes);
}

// --------------------------------------------------------------------------------------------
// SwiGLU on the fused fc1 output.  input: x [..., 2F] (first half gate a, second half up b).
// output: y [..., F] = silu(a) * b.
template <class T>
int swiglu_fwd(void **params, int *ndims, int64_t **shapes) {
  if (ndims[0] < 1) return kErrShape;
  const int64_t two_f = shapes[0][ndims[0] - 1];
  if (two_f % 2 != 0) return kErrShape;
  const int64_t f = two_f / 2;
  const int64_t total = numel(ndims[0], shapes[0]);
  if (numel(ndims[1], shapes[1]) * 2 != total) return kErrShape;
  const int64_t rows = two_f > 0 ? total / two_f : 0;
  const T *x = static_cast<const T *>(params[0]);
  T *y = static_cast<T *>(params[1]);
  const int nt = threads_for(total, rows);
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
  for (int64_t i = 0; i < rows; ++i) {
    const T *a = x + i * two_f;
    const T *b = a + f;
    T *yr = y + i * f;
#pragma omp simd
    for (int64_t j = 0; j < f; ++j) {
      const float aj = to_f32(a[j]);
      yr[j] = from_f32<T>(aj * sigmoid_f(aj) * to_f32(b[j]));
    }
  }
  return 0;
}

MSLLM_EXPORT int SwigluFwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                           void *) {
  if (nparam != 2) return kErrNParam;
  const int kind = storage_kind(dtypes, {0, 1});
  if (kind < 0) return kErrDtype;
  return kind ? swiglu_fwd<uint16_t>(params, ndims, shapes) : swiglu_fwd<float>(params, ndims, shapes);
}

// SwiGLU backward.  inputs: x [..., 2F], dy [..., F].  output: dx [..., 2F].
//   s = sigmoid(a);  da = dy * b * s * (1 + a * (1 - s));  db = dy * a * s
template <class T>
int swiglu_bwd(void **params, int *ndims, int64_t **shapes) {
  if (ndims[0] < 1) return kErrShape;
  const int64_t two_f = shapes[0][ndims[0] - 1];
  if (two_f % 2 != 0) return kErrShape;
  const int64_t f = two_f / 2;
  const int64_t total = numel(ndims[0], shapes[0]);
  if (numel(ndims[1], shapes[1]) * 2 != total || numel(ndims[2], shapes[2]) != total) return kErrShape;
  const int64_t rows = two_f > 0 ? total / two_f : 0;
  const T *x = static_cast<const T *>(params[0]);
  const T *dy = static_cast<const T *>(params[1]);
  T *dx = static_cast<T *>(params[2]);
  const int nt = threads_for(total, rows);
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
  for (int64_t i = 0; i < rows; ++i) {
    const T *a = x + i * two_f;
    const T *b = a + f;
    const T *g = dy + i * f;
    T *da = dx + i * two_f;
    T *db = da + f;
#pragma omp simd
    for (int64_t j = 0; j < f; ++j) {
      const float aj = to_f32(a[j]), gj = to_f32(g[j]);
      const float s = sigmoid_f(aj);
      const float as = aj * s;
      da[j] = from_f32<T>(gj * to_f32(b[j]) * (s + as * (1.0f - s)));
      db[j] = from_f32<T>(gj * as);
    }
  }
  return 0;
}

MSLLM_EXPORT int SwigluBwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                           void *) {
  if (nparam != 3) return kErrNParam;
  const int kind = storage_kind(dtypes, {0, 1, 2});
  if (kind < 0) return kErrDtype;
  return kind ? swiglu_bwd<uint16_t>(params, ndims, shapes) : swiglu_bwd<float>(params, ndims, shapes);
}

// --------------------------------------------------------------------------------------------
// Cross entropy per token.  inputs: logits [N, V] f32 or bf16, labels [N] int32/int64, ignore_index
// scalar.  outputs: loss [N] f32 (0 where labels == ignore_index), lse [N] f32 (logsumexp per row, 0
// where ignored), kept for the backward. Each row is read twice (max, then sum of exp), the second
// read from cache. bf16 logits are widened on load (the numbers of an fp32 cast first, without the
// cast's pass over [N, V]). A label outside [0, V) that is not ignore_index is an error.
namespace {
template <class T>
int ce_fwd_t(void **params, int64_t n, int64_t v, bool lab64, int64_t ignore) {
  const T *x = static_cast<const T *>(params[0]);
  float *loss = static_cast<float *>(params[3]);
  float *lse = static_cast<float *>(params[4]);
  int bad = 0;
  const int nt = threads_for(n * v, n);
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1) reduction(| : bad)
  for (int64_t i = 0; i < n; ++i) {
    const int64_t lab = lab64 ? static_cast<const int64_t *>(params[1])[i]
                              : static_cast<int64_t>(static_cast<const int32_t *>(params[1])[i]);
    if (lab == ignore) {
      loss[i] = 0.f;
      lse[i] = 0.f;
      continue;
    }
    if (lab < 0 || lab >= v) {
      bad = 1;
      loss[i] = NAN;
      lse[i] = NAN;
      continue;
    }
    const T *xr = x + i * v;
    const float m = row_max(xr, v);
    const float l = m + std::log(row_sum_exp(xr, v, 1.0f, m));
    lse[i] = l;
    loss[i] = l - to_f32(xr[lab]);
  }
  return bad ? kErrLabel : 0;
}

// dlogits in fp32, stored once in T (bf16: rounded as an fp32 result cast afterwards would be).
template <class T>
int ce_bwd_t(void **params, int64_t n, int64_t v, bool lab64, int64_t ignore) {
  const T *x = static_cast<const T *>(params[0]);
  const float *lse = static_cast<const float *>(params[2]);
  const float *dl = static_cast<const float *>(params[3]);
  T *dx = static_cast<T *>(params[5]);
  int bad = 0;
  const int nt = threads_for(n * v, n);
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1) reduction(| : bad)
  for (int64_t i = 0; i < n; ++i) {
    const int64_t lab = lab64 ? static_cast<const int64_t *>(params[1])[i]
                              : static_cast<int64_t>(static_cast<const int32_t *>(params[1])[i]);
    T *dr = dx + i * v;
    if (lab == ignore || lab < 0 || lab >= v) {
      bad |= lab != ignore;
      std::memset(dr, 0, sizeof(T) * v);   // +0.0 in fp32 and bf16
      continue;
    }
    const T *xr = x + i * v;
    const float l = lse[i];
    const float g = dl[i];
#pragma omp simd
    for (int64_t j = 0; j < v; ++j) dr[j] = from_f32<T>(exp_f(to_f32(xr[j]) - l) * g);
    dr[lab] = from_f32<T>(exp_f(to_f32(xr[lab]) - l) * g - g);
  }
  return bad ? kErrLabel : 0;
}
}  // namespace

MSLLM_EXPORT int CrossEntropyFwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                 void *, void *) {
  if (nparam != 5) return kErrNParam;
  const int kind = storage_kind(dtypes, {0});
  if (kind < 0 || !is_f32(dtypes[3]) || !is_f32(dtypes[4])) return kErrDtype;
  const bool lab64 = is_i64(dtypes[1]);
  if (!lab64 && !is_i32(dtypes[1])) return kErrDtype;
  if (ndims[0] < 1 || shapes[0][ndims[0] - 1] <= 0) return kErrShape;  // logits [..., V]: rows of V
  const int64_t v = shapes[0][ndims[0] - 1], n = numel(ndims[0], shapes[0]) / v;
  if (numel(ndims[1], shapes[1]) != n || numel(ndims[3], shapes[3]) != n || numel(ndims[4], shapes[4]) != n)
    return kErrShape;
  double ign_d;
  if (!read_scalar(params[2], dtypes[2], &ign_d)) return kErrDtype;
  const int64_t ignore = static_cast<int64_t>(ign_d);
  return kind ? ce_fwd_t<uint16_t>(params, n, v, lab64, ignore) : ce_fwd_t<float>(params, n, v, lab64, ignore);
}

// Cross entropy backward.  inputs: logits [N, V] (or [..., V], N rows), labels [N], lse [N], dloss [N],
// ignore_index.
// output: dlogits [N, V] (logits' dtype) = (softmax(logits) - onehot(labels)) * dloss[:, None];
// 0 for ignored rows.
MSLLM_EXPORT int CrossEntropyBwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                 void *, void *) {
  if (nparam != 6) return kErrNParam;
  const int kind = storage_kind(dtypes, {0, 5});
  if (kind < 0 || !is_f32(dtypes[2]) || !is_f32(dtypes[3])) return kErrDtype;
  const bool lab64 = is_i64(dtypes[1]);
  if (!lab64 && !is_i32(dtypes[1])) return kErrDtype;
  if (ndims[0] < 1 || shapes[0][ndims[0] - 1] <= 0) return kErrShape;  // logits [..., V]: rows of V
  const int64_t v = shapes[0][ndims[0] - 1], n = numel(ndims[0], shapes[0]) / v;
  if (numel(ndims[1], shapes[1]) != n || numel(ndims[2], shapes[2]) != n || numel(ndims[3], shapes[3]) != n ||
      numel(ndims[5], shapes[5]) != n * v)
    return kErrShape;
  double ign_d;
  if (!read_scalar(params[4], dtypes[4], &ign_d)) return kErrDtype;
  const int64_t ignore = static_cast<int64_t>(ign_d);
  return kind ? ce_bwd_t<uint16_t>(params, n, v, lab64, ignore) : ce_bwd_t<float>(params, n, v, lab64, ignore);
}

// --------------------------------------------------------------------------------------------
// Causal softmax over the last axis of scores [..., Sq, Sk] with a scale:
//   y[q, k] = softmax_k(scale * x[q, k]) over the allowed keys k <= q + (Sk - Sq), and 0 elsewhere.
// inputs: x f32, scale scalar.  output: y f32 (same shape). Masked positions are never read.
MSLLM_EXPORT int CausalSoftmaxFwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                  void *, void *) {
  if (nparam != 3) return kErrNParam;
  if (!is_f32(dtypes[0]) || !is_f32(dtypes[2])) return kErrDtype;
  if (ndims[0] < 2) return kErrShape;
  const int64_t sq = shapes[0][ndims[0] - 2], sk = shapes[0][ndims[0] - 1];
  const int64_t total = numel(ndims[0], shapes[0]);
  if (numel(ndims[2], shapes[2]) != total) return kErrShape;
  double scale_d;
  if (!read_scalar(params[1], dtypes[1], &scale_d)) return kErrDtype;
  const float scale = static_cast<float>(scale_d);
  const int64_t rows = sk > 0 ? total / sk : 0;
  const int64_t off = sk - sq;
  const float *x = static_cast<const float *>(params[0]);
  float *y = static_cast<float *>(params[2]);
  const int nt = threads_for(total / 2, rows);
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t q = i % sq;
    int64_t len = q + off + 1;  // allowed keys: [0, len)
    if (len > sk) len = sk;
    if (len < 0) len = 0;
    const float *xr = x + i * sk;
    float *yr = y + i * sk;
    if (len > 0) {
      float mm;  // max_k(scale * x[k])
      if (scale >= 0.f) {
        mm = scale * row_max(xr, len);
      } else {  // scale < 0: max of scale*x is scale*min(x)
        float mn = INFINITY;
#pragma omp simd reduction(min : mn)
        for (int64_t j = 0; j < len; ++j) mn = xr[j] < mn ? xr[j] : mn;
        mm = scale * mn;
      }
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t j = 0; j < len; ++j) {
        const float e = exp_f(scale * xr[j] - mm);
        yr[j] = e;
        s += e;
      }
      const float inv = 1.0f / s;
#pragma omp simd
      for (int64_t j = 0; j < len; ++j) yr[j] *= inv;
    }
    if (len < sk) std::memset(yr + len, 0, sizeof(float) * (sk - len));
  }
  return 0;
}

// Causal softmax backward.  inputs: y (forward output), dy, scale.  output: dx
//   dx = scale * y * (dy - sum_k(dy * y)) on allowed positions, 0 on masked ones.
MSLLM_EXPORT int CausalSoftmaxBwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                  void *, void *) {
  if (nparam != 4) return kErrNParam;
  if (!is_f32(dtypes[0]) || !is_f32(dtypes[1]) || !is_f32(dtypes[3])) return kErrDtype;
  if (ndims[0] < 2) return kErrShape;
  const int64_t sq = shapes[0][ndims[0] - 2], sk = shapes[0][ndims[0] - 1];
  const int64_t total = numel(ndims[0], shapes[0]);
  if (numel(ndims[1], shapes[1]) != total || numel(ndims[3], shapes[3]) != total) return kErrShape;
  double scale_d;
  if (!read_scalar(params[2], dtypes[2], &scale_d)) return kErrDtype;
  const float scale = static_cast<float>(scale_d);
  const int64_t rows = sk > 0 ? total / sk : 0;
  const int64_t off = sk - sq;
  const float *y = static_cast<const float *>(params[0]);
  const float *dy = static_cast<const float *>(params[1]);
  float *dx = static_cast<float *>(params[3]);
  const int nt = threads_for(total / 2, rows);
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t q = i % sq;
    int64_t len = q + off + 1;
    if (len > sk) len = sk;
    if (len < 0) len = 0;
    const float *yr = y + i * sk;
    const float *gr = dy + i * sk;
    float *dr = dx + i * sk;
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t j = 0; j < len; ++j) dot += gr[j] * yr[j];
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) dr[j] = scale * yr[j] * (gr[j] - dot);
    if (len < sk) std::memset(dr + len, 0, sizeof(float) * (sk - len));
  }
  return 0;
}

// --------------------------------------------------------------------------------------------
// Rotary embedding, rotate-half form:  y = x * cos + rotate_half(x) * sin,
// rotate_half([x1, x2]) = [-x2, x1] on the last axis (D even).
// inputs: x [..., S, ..., D] f32, cos [S, D] f32, sin [S, D] f32, seq_dim scalar (axis of S in x,
// negative allowed).  output: y, shape of x.  x is viewed as [outer, S, inner, D].
namespace {
bool rope_geometry(int nd, const int64_t *shape, int64_t seq_dim, int64_t *outer, int64_t *s, int64_t *inner,
                   int64_t *d) {
  if (nd < 2) return false;
  if (seq_dim < 0) seq_dim += nd;
  if (seq_dim < 0 || seq_dim >= nd - 1) return false;
  *outer = 1;
  for (int i = 0; i < seq_dim; ++i) *outer *= shape[i];
  *s = shape[seq_dim];
  *inner = 1;
  for (int i = static_cast<int>(seq_dim) + 1; i < nd - 1; ++i) *inner *= shape[i];
  *d = shape[nd - 1];
  return *d % 2 == 0;
}

// sign = +1: forward.  y1 = x1*c1 - x2*s1 ; y2 = x2*c2 + x1*s2
// sign = -1: backward. dx1 = g1*c1 + g2*s2 ; dx2 = g2*c2 - g1*s1
// x / y fp32 or bf16 (the same), cos / sin fp32.
template <class T>
int rope_t(void **params, int *ndims, int64_t **shapes, const char **dtypes, bool backward) {
  double sd;
  if (!read_scalar(params[3], dtypes[3], &sd)) return kErrDtype;
  int64_t outer, s, inner, d;
  if (!rope_geometry(ndims[0], shapes[0], static_cast<int64_t>(sd), &outer, &s, &inner, &d)) return kErrShape;
  if (numel(ndims[1], shapes[1]) != s * d || numel(ndims[2], shapes[2]) != s * d ||
      numel(ndims[4], shapes[4]) != numel(ndims[0], shapes[0]))
    return kErrShape;
  const T *x = static_cast<const T *>(params[0]);
  const float *cs = static_cast<const float *>(params[1]);
  const float *sn = static_cast<const float *>(params[2]);
  T *y = static_cast<T *>(params[4]);
  const int64_t half = d / 2;
  const int64_t rows = outer * s;  // one (outer, s) pair = inner vectors sharing cos/sin
  const int nt = threads_for(rows * inner * d, rows);
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t si = r % s;
    const float *c = cs + si * d;
    const float *sv = sn + si * d;
    for (int64_t k = 0; k < inner; ++k) {
      const T *xv = x + (r * inner + k) * d;
      T *yv = y + (r * inner + k) * d;
      if (!backward) {
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) {
          const float x1 = to_f32(xv[j]), x2 = to_f32(xv[j + half]);
          yv[j] = from_f32<T>(x1 * c[j] - x2 * sv[j]);
          yv[j + half] = from_f32<T>(x2 * c[j + half] + x1 * sv[j + half]);
        }
      } else {
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) {
          const float g1 = to_f32(xv[j]), g2 = to_f32(xv[j + half]);
          yv[j] = from_f32<T>(g1 * c[j] + g2 * sv[j + half]);
          yv[j + half] = from_f32<T>(g2 * c[j + half] - g1 * sv[j]);
        }
      }
    }
  }
  return 0;
}
int rope_impl(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, bool backward) {
  if (nparam != 5) return kErrNParam;
  if (!is_f32(dtypes[1]) || !is_f32(dtypes[2])) return kErrDtype;
  const int kind = storage_kind(dtypes, {0, 4});
  if (kind < 0) return kErrDtype;
  return kind ? rope_t<uint16_t>(params, ndims, shapes, dtypes, backward)
              : rope_t<float>(params, ndims, shapes, dtypes, backward);
}
}  // namespace

MSLLM_EXPORT int RopeFwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                         void *) {
  return rope_impl(nparam, params, ndims, shapes, dtypes, false);
}

// inputs: dy, cos, sin, seq_dim.  output: dx.
MSLLM_EXPORT int RopeBwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                         void *) {
  return rope_impl(nparam, params, ndims, shapes, dtypes, true);
}

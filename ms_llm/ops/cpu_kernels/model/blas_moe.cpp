// Dropless mixture-of-experts kernels for ms-llm (fp32, CPU), called through ops.Custom(func_type="aot")
// from blas_moe.py. Built into libmsllm_blas_kernels.so with blas_kernels.cpp (see build.py).
//
// Why: a MoE layer with many small experts (e.g. 64 experts of FFN 256, top-8) issued ~6 framework ops
// per expert per direction in PyNative (split, two matmuls, SwiGLU, cat, and their backward), plus the
// sort / inverse-permutation / count ops and the gather-multiply-sum of the combine. Each op costs a
// dispatch and a thread-pool wake-up on a 2-core CPU. These kernels do the same arithmetic in five
// ops per layer (two forward, three backward ones), with the per-expert GEMMs issued back to back
// inside one call:
//   MoeSortByExpert   top-k expert ids [T, k] -> sorted slots, inverse permutation, counts (counting sort)
//   MoePermuteRows    rows of x in expert order; backward sums each token's k row gradients
//   MoeExpertFfnFwd   per expert block: h = x W1, a = silu(gate) * up, y = a W2 (h kept for backward)
//   MoeExpertFfnBwd   dx, dW1_e, dW2_e of the above (empty experts get zero weight gradients)
//   MoeCombine        out[t] = sum_j probs[t, j] * rows[restore[t k + j]]; backward: d rows, d probs
// Signature of every kernel as in blas_kernels.cpp (inputs, then outputs, in `params`).
//
// Expert weights come either as one stacked tensor [E, ...] per projection or as E separate
// tensors (Megatron's SequentialMLP keeps one Parameter per expert: no stacking copy per step).
// Layout flag tb = 1: Linear layout, W1_e [2F, H], W2_e [H, F]; tb = 0: W1_e [H, 2F], W2_e [F, H].

#include <cblas.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_math.h"

#define MSLLM_EXPORT extern "C" __attribute__((visibility("default")))

using namespace msllm;

namespace {


bool read_flag(const void *p, const char *d, int64_t *out) {
  if (std::strcmp(d, "int64") == 0 || std::strcmp(d, "int") == 0) *out = *static_cast<const int64_t *>(p);
  else if (is_i32(d)) *out = *static_cast<const int32_t *>(p);
  else if (std::strcmp(d, "bool") == 0) *out = *static_cast<const bool *>(p) ? 1 : 0;
  else return false;
  return true;
}

bool fits(int64_t v) { return v >= 0 && v < (int64_t(1) << 31); }

// C[m, n] = op(A) op(B) + beta C, row-major; ta / tb as in blas_kernels.cpp's gemm().
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float *a, const float *b, float beta,
          float *c) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (beta == 0.f) std::memset(c, 0, sizeof(float) * m * n);
    return;
  }
  scipy_cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                    static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k), 1.0f, a,
                    static_cast<blasint>(ta ? m : k), b, static_cast<blasint>(tb ? k : n), beta, c,
                    static_cast<blasint>(n));
}

inline float sigm(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// The expert weights of one call: `nw` tensors per projection (1 = stacked [E, ...], E = one each).
struct ExpertWeights {
  int nw = 0;
  int64_t e = 0, h = 0, f = 0;  // experts, hidden, moe ffn
  bool tb = true;
  std::vector<float *> w1, w2;  // per expert
  // Validate shapes of params[first .. first + 2 nw) and fill the per-expert pointers.
  bool init(void **params, int *ndims, int64_t **shapes, const char **dtypes, int first, int nw_,
            int64_t experts, int64_t hidden, bool tb_) {
    nw = nw_, e = experts, h = hidden, tb = tb_;
    if (nw != 1 && nw != e) return false;
    const int off = nw == 1 ? 1 : 0;  // leading expert axis of a stacked tensor
    for (int i = 0; i < 2 * nw; ++i) {
      if (!is_f32(dtypes[first + i]) || ndims[first + i] != 2 + off) return false;
      if (off && shapes[first + i][0] != e) return false;
    }
    const int64_t *s1 = shapes[first] + off, *s2 = shapes[first + nw] + off;
    // tb: W1 [2F, H], W2 [H, F]; else W1 [H, 2F], W2 [F, H]
    const int64_t two_f = tb ? s1[0] : s1[1];
    if ((tb ? s1[1] : s1[0]) != h || two_f % 2) return false;
    f = two_f / 2;
    if (tb ? (s2[0] != h || s2[1] != f) : (s2[0] != f || s2[1] != h)) return false;
    for (int i = 0; i < 2 * nw; ++i)
      for (int d = 0; d < 2; ++d)
        if (shapes[first + i][off + d] != shapes[first + (i < nw ? 0 : nw)][off + d]) return false;
    const int64_t per = 2 * f * h;
    for (int64_t x = 0; x < e; ++x) {
      float *p1 = static_cast<float *>(params[first + (nw == 1 ? 0 : x)]);
      float *p2 = static_cast<float *>(params[first + nw + (nw == 1 ? 0 : x)]);
      w1.push_back(nw == 1 ? p1 + x * per : p1);
      w2.push_back(nw == 1 ? p2 + x * per / 2 : p2);
    }
    return true;
  }
};

// Block sizes (int32 [E]) -> row offsets; false if negative or not summing to n.
bool offsets(const void *p, const char *d, int64_t e, int64_t n, std::vector<int64_t> *off) {
  if (!is_i32(d)) return false;
  const int32_t *s = static_cast<const int32_t *>(p);
  off->assign(static_cast<size_t>(e + 1), 0);
  for (int64_t i = 0; i < e; ++i) {
    if (s[i] < 0) return false;
    (*off)[i + 1] = (*off)[i] + s[i];
  }
  return (*off)[e] == n;
}

}  // namespace

// (top_idx int32 [T, k], proto int32 [E] (its shape gives E)) -> (sorted_slots int32 [T k],
// restore int32 [T k], counts int32 [E])
// sorted_slots is expert-major with slot order inside each expert (a stable counting sort);
// restore is its inverse. Expert ids outside [0, E) are an error.
MSLLM_EXPORT int MoeSortByExpert(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                 void *, void *) {
  if (nparam != 5) return kErrNParam;
  for (int i = 0; i < 5; ++i)
    if (!is_i32(dtypes[i])) return kErrDtype;
  const int64_t n = numel(ndims[0], shapes[0]), e = numel(ndims[1], shapes[1]);
  if (numel(ndims[2], shapes[2]) != n || numel(ndims[3], shapes[3]) != n || !fits(n) ||
      numel(ndims[4], shapes[4]) != e)
    return kErrShape;
  const int32_t *idx = static_cast<const int32_t *>(params[0]);
  int32_t *sorted = static_cast<int32_t *>(params[2]), *restore = static_cast<int32_t *>(params[3]);
  int32_t *counts = static_cast<int32_t *>(params[4]);
  std::memset(counts, 0, sizeof(int32_t) * e);
  for (int64_t s = 0; s < n; ++s) {
    if (idx[s] < 0 || idx[s] >= e) return kErrLabel;
    ++counts[idx[s]];
  }
  std::vector<int64_t> next(static_cast<size_t>(e), 0);
  for (int64_t x = 1; x < e; ++x) next[x] = next[x - 1] + counts[x - 1];
  for (int64_t s = 0; s < n; ++s) {
    const int64_t row = next[idx[s]]++;
    sorted[row] = static_cast<int32_t>(s);
    restore[s] = static_cast<int32_t>(row);
  }
  return 0;
}

// (x [T, H], sorted_slots int32 [N], restore int32 [N]) -> rows [N, H], rows[i] = x[sorted[i] / k],
// k = N / T.
MSLLM_EXPORT int MoePermuteRows(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                void *, void *) {
  if (nparam != 4) return kErrNParam;
  if (!is_f32(dtypes[0]) || !is_i32(dtypes[1]) || !is_f32(dtypes[3]) || ndims[0] != 2) return kErrDtype;
  const int64_t t = shapes[0][0], h = shapes[0][1], n = numel(ndims[1], shapes[1]);
  if (t == 0 || n % t || numel(ndims[3], shapes[3]) != n * h) return kErrShape;
  const int64_t k = n / t;
  const float *x = static_cast<const float *>(params[0]);
  const int32_t *sorted = static_cast<const int32_t *>(params[1]);
  float *rows = static_cast<float *>(params[3]);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = sorted[i];
    if (s < 0 || s >= n) return kErrLabel;
    std::memcpy(rows + i * h, x + (s / k) * h, sizeof(float) * h);
  }
  return 0;
}

// (d_rows [N, H], restore int32 [N], x [T, H]) -> dx [T, H], dx[t] = sum_j d_rows[restore[t k + j]].
MSLLM_EXPORT int MoePermuteRowsBwd(int nparam, void **params, int *ndims, int64_t **shapes,
                                   const char **dtypes, void *, void *) {
  if (nparam != 4) return kErrNParam;
  if (!is_f32(dtypes[0]) || !is_i32(dtypes[1]) || !is_f32(dtypes[3]) || ndims[0] != 2) return kErrDtype;
  const int64_t n = shapes[0][0], h = shapes[0][1], t = numel(ndims[3], shapes[3]) / (h ? h : 1);
  if (numel(ndims[1], shapes[1]) != n || t == 0 || n % t) return kErrShape;
  const int64_t k = n / t;
  const float *dr = static_cast<const float *>(params[0]);
  const int32_t *restore = static_cast<const int32_t *>(params[1]);
  float *dx = static_cast<float *>(params[3]);
  for (int64_t i = 0; i < t; ++i) {
    float *o = dx + i * h;
    std::memset(o, 0, sizeof(float) * h);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = restore[i * k + j];
      if (r < 0 || r >= n) return kErrLabel;
      const float *src = dr + r * h;
#pragma omp simd
      for (int64_t c = 0; c < h; ++c) o[c] += src[c];
    }
  }
  return 0;
}

// (rows [N, H], restore int32 [N], probs [T, k]) -> out [T, H], out[t] = sum_j probs[t, j] rows[restore[t k + j]]
MSLLM_EXPORT int MoeCombine(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                            void *, void *) {
  if (nparam != 4) return kErrNParam;
  if (!is_f32(dtypes[0]) || !is_i32(dtypes[1]) || !is_f32(dtypes[2]) || !is_f32(dtypes[3])) return kErrDtype;
  if (ndims[0] != 2 || ndims[2] != 2) return kErrShape;
  const int64_t n = shapes[0][0], h = shapes[0][1], t = shapes[2][0], k = shapes[2][1];
  if (numel(ndims[1], shapes[1]) != n || t * k != n || numel(ndims[3], shapes[3]) != t * h) return kErrShape;
  const float *rows = static_cast<const float *>(params[0]), *probs = static_cast<const float *>(params[2]);
  const int32_t *restore = static_cast<const int32_t *>(params[1]);
  float *out = static_cast<float *>(params[3]);
  for (int64_t i = 0; i < t; ++i) {
    float *o = out + i * h;
    std::memset(o, 0, sizeof(float) * h);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = restore[i * k + j];
      if (r < 0 || r >= n) return kErrLabel;
      const float p = probs[i * k + j], *src = rows + r * h;
#pragma omp simd
      for (int64_t c = 0; c < h; ++c) o[c] += p * src[c];
    }
  }
  return 0;
}

// (rows [N, H], restore [N], probs [T, k], dout [T, H]) -> (d_rows [N, H], d_probs [T, k])
MSLLM_EXPORT int MoeCombineBwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                               void *, void *) {
  if (nparam != 6) return kErrNParam;
  if (!is_f32(dtypes[0]) || !is_i32(dtypes[1]) || !is_f32(dtypes[2]) || !is_f32(dtypes[3]) ||
      !is_f32(dtypes[4]) || !is_f32(dtypes[5]))
    return kErrDtype;
  if (ndims[0] != 2 || ndims[2] != 2) return kErrShape;
  const int64_t n = shapes[0][0], h = shapes[0][1], t = shapes[2][0], k = shapes[2][1];
  if (numel(ndims[1], shapes[1]) != n || t * k != n || numel(ndims[3], shapes[3]) != t * h ||
      numel(ndims[4], shapes[4]) != n * h || numel(ndims[5], shapes[5]) != t * k)
    return kErrShape;
  const float *rows = static_cast<const float *>(params[0]), *probs = static_cast<const float *>(params[2]);
  const float *dout = static_cast<const float *>(params[3]);
  const int32_t *restore = static_cast<const int32_t *>(params[1]);
  float *drows = static_cast<float *>(params[4]), *dprobs = static_cast<float *>(params[5]);
  for (int64_t i = 0; i < t; ++i) {
    const float *g = dout + i * h;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = restore[i * k + j];
      if (r < 0 || r >= n) return kErrLabel;
      const float p = probs[i * k + j], *src = rows + r * h;
      float *d = drows + r * h, acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t c = 0; c < h; ++c) {
        d[c] = p * g[c];
        acc += g[c] * src[c];
      }
      dprobs[i * k + j] = acc;
    }
  }
  return 0;
}

// (x [N, H], sizes int32 [E], tb, W1 x nw, W2 x nw) -> (y [N, H], h [N, 2F])
MSLLM_EXPORT int MoeExpertFfnFwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                 void *, void *) {
  const int nw = (nparam - 5) / 2;
  if (nparam < 7 || (nparam - 5) % 2) return kErrNParam;
  if (!is_f32(dtypes[0]) || ndims[0] != 2) return kErrDtype;
  int64_t tbv;
  if (!read_flag(params[2], dtypes[2], &tbv)) return kErrDtype;
  const int64_t n = shapes[0][0], hid = shapes[0][1], e = numel(ndims[1], shapes[1]);
  ExpertWeights w;
  if (!w.init(params, ndims, shapes, dtypes, 3, nw, e, hid, tbv != 0)) return kErrShape;
  const int yo = 3 + 2 * nw, ho = yo + 1;
  const int64_t f = w.f;
  if (numel(ndims[yo], shapes[yo]) != n * hid || numel(ndims[ho], shapes[ho]) != n * 2 * f) return kErrShape;
  if (!fits(n) || !fits(hid) || !fits(2 * f)) return kErrTooLarge;
  std::vector<int64_t> off;
  if (!offsets(params[1], dtypes[1], e, n, &off)) return kErrLabel;
  const float *x = static_cast<const float *>(params[0]);
  float *y = static_cast<float *>(params[yo]), *hbuf = static_cast<float *>(params[ho]);
  std::vector<float> act;
  for (int64_t x_e = 0; x_e < e; ++x_e) {
    const int64_t r0 = off[x_e], m = off[x_e + 1] - r0;
    if (m == 0) continue;
    float *h = hbuf + r0 * 2 * f;
    gemm(false, w.tb, m, 2 * f, hid, x + r0 * hid, w.w1[x_e], 0.f, h);
    act.resize(static_cast<size_t>(m * f));
    for (int64_t i = 0; i < m; ++i) {
      const float *g = h + i * 2 * f, *u = g + f;
      float *a = act.data() + i * f;
#pragma omp simd
      for (int64_t c = 0; c < f; ++c) a[c] = g[c] * sigm(g[c]) * u[c];
    }
    gemm(false, w.tb, m, hid, f, act.data(), w.w2[x_e], 0.f, y + r0 * hid);
  }
  return 0;
}

// (x [N, H], sizes [E], tb, h [N, 2F], dy [N, H], W1 x nw, W2 x nw) -> (dx [N, H], dW1 x nw, dW2 x nw)
MSLLM_EXPORT int MoeExpertFfnBwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                 void *, void *) {
  if (nparam < 10 || (nparam - 6) % 4) return kErrNParam;
  const int nw = (nparam - 6) / 4;
  for (int i : {0, 3, 4})
    if (!is_f32(dtypes[i]) || ndims[i] != 2) return kErrDtype;
  int64_t tbv;
  if (!read_flag(params[2], dtypes[2], &tbv)) return kErrDtype;
  const int64_t n = shapes[0][0], hid = shapes[0][1], e = numel(ndims[1], shapes[1]);
  ExpertWeights w, dw;
  if (!w.init(params, ndims, shapes, dtypes, 5, nw, e, hid, tbv != 0)) return kErrShape;
  const int dxo = 5 + 2 * nw;
  if (!dw.init(params, ndims, shapes, dtypes, dxo + 1, nw, e, hid, tbv != 0) || dw.f != w.f) return kErrShape;
  const int64_t f = w.f;
  if (shapes[3][0] != n || shapes[3][1] != 2 * f || shapes[4][0] != n || shapes[4][1] != hid ||
      numel(ndims[dxo], shapes[dxo]) != n * hid)
    return kErrShape;
  if (!fits(n) || !fits(hid) || !fits(2 * f)) return kErrTooLarge;
  std::vector<int64_t> off;
  if (!offsets(params[1], dtypes[1], e, n, &off)) return kErrLabel;
  const float *x = static_cast<const float *>(params[0]), *hbuf = static_cast<const float *>(params[3]);
  const float *dy = static_cast<const float *>(params[4]);
  float *dx = static_cast<float *>(params[dxo]);
  std::vector<float> act, da, dh;
  for (int64_t x_e = 0; x_e < e; ++x_e) {
    const int64_t r0 = off[x_e], m = off[x_e + 1] - r0;
    if (m == 0) {
      std::memset(dw.w1[x_e], 0, sizeof(float) * 2 * f * hid);
      std::memset(dw.w2[x_e], 0, sizeof(float) * f * hid);
      continue;
    }
    const float *h = hbuf + r0 * 2 * f, *dye = dy + r0 * hid, *xe = x + r0 * hid;
    act.resize(static_cast<size_t>(m * f));
    da.resize(static_cast<size_t>(m * f));
    dh.resize(static_cast<size_t>(m * 2 * f));
    // da = dy W2^T in the forward's orientation: tb (W2 [H, F]): dy W2; else (W2 [F, H]): dy W2^T
    gemm(false, !w.tb, m, f, hid, dye, w.w2[x_e], 0.f, da.data());
    for (int64_t i = 0; i < m; ++i) {
      const float *g = h + i * 2 * f, *u = g + f, *d = da.data() + i * f;
      float *a = act.data() + i * f, *dg = dh.data() + i * 2 * f, *du = dg + f;
#pragma omp simd
      for (int64_t c = 0; c < f; ++c) {
        const float s = sigm(g[c]), gs = g[c] * s;
        a[c] = gs * u[c];
        dg[c] = d[c] * u[c] * (s + gs * (1.0f - s));
        du[c] = d[c] * gs;
      }
    }
    // dx = dh W1^T(fwd orientation): tb (W1 [2F, H]): dh W1; else (W1 [H, 2F]): dh W1^T
    gemm(false, !w.tb, m, hid, 2 * f, dh.data(), w.w1[x_e], 0.f, dx + r0 * hid);
    if (w.tb) {
      gemm(true, false, hid, f, m, dye, act.data(), 0.f, dw.w2[x_e]);         // dW2 = dy^T a  [H, F]
      gemm(true, false, 2 * f, hid, m, dh.data(), xe, 0.f, dw.w1[x_e]);       // dW1 = dh^T x  [2F, H]
    } else {
      gemm(true, false, f, hid, m, act.data(), dye, 0.f, dw.w2[x_e]);         // dW2 = a^T dy  [F, H]
      gemm(true, false, hid, 2 * f, m, xe, dh.data(), 0.f, dw.w1[x_e]);       // dW1 = x^T dh  [H, 2F]
    }
  }
  return 0;
}

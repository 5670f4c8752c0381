// One (query chunk, key block) pair of blockwise attention, forward and backward, on OpenBLAS
// sgemm: the arithmetic context parallel runs for every pair a ring step brings
// (parallel/context_parallel/kernel.py: ``pair_forward`` / ``pair_backward``).
//
// Why: composed of MindSpore ops, one pair is ~20 ops (scores, bias, max, exp, sums, the
// broadcast subtractions), and on CPU the elementwise ones were 29 % of a cp = 2 step of the 55M
// model at seq 1024 (profiled: SubExt alone 1.07 s of 8.7 s of kernel time per two steps); here
// they run inside the row loop between three (forward) or five (backward) GEMMs.
//
// Layout (kernel.py's grouped layout, no K/V expansion):
//   q [B, G, R*C, D] fp32, rows h*C + i (the R query heads of KV group g, chunk position i)
//   k, v [B, G, K, D];  bias: an additive fp32 mask [NB, C, K] (NB = 1 or B; row i of every head
//   reads bias row i), or any tensor whose last two dims are not (C, K): no mask;  scale: 0-d
//   PairAttnFwd: (q, k, v, bias, scale) -> (o [B, G, R*C, D] normalised, lse [B, G, R*C])
//       s = scale * q k^T + bias;  o = softmax(s) v;  lse = logsumexp(s)
//   PairAttnBwd: (q, k, v, do, delta, lse, bias, scale) -> (dq, dk, dv)
//       p = exp(s - lse) with the merged (global) lse;  dv = p^T do;  ds = scale p (do v^T - delta)
//       dq = ds k;  dk = ds^T q;  delta = rowsum(do * o) of the merged output
// exp(x) below exp_f's range (a masked entry, bias -1e30) is exactly 0, as mint.exp gives.
// Rows are processed kRows at a time, so scratch stays kRows x K floats per thread.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "blas_gemm.h"
#include "cpu_math.h"

#define MSLLM_EXPORT extern "C" __attribute__((visibility("default")))

using namespace msllm;

namespace {

constexpr int64_t kRows = 256;  // query rows per GEMM block

struct Pair {
  const float *q, *k, *v, *bias;  // bias null: no mask
  int64_t g_per_batch, nb, rows, c, kl, d;
  float scale;

  const float *bias_row(int64_t slice, int64_t row) const {
    if (!bias) return nullptr;
    const int64_t b = nb == 1 ? 0 : slice / g_per_batch;
    return bias + (b * c + row % c) * kl;
  }
};

inline float exp0(float x) { return x < -87.0f ? 0.0f : exp_f(x); }

// Reads the 4-D shapes shared by both kernels (q [B, G, rows, D], k and v [B, G, K, D]) and the
// operands q, k, v, bias: a bias [NB, C, K] with rows % C == 0 is a mask (NB must be 1 or B),
// anything else is none. False on a mismatch or a dimension past OpenBLAS's 32-bit blasint.
bool read_pair(void **params, int *ndims, int64_t **shapes, int bias_at, Pair *p) {
  if (ndims[0] != 4 || ndims[1] != 4 || ndims[2] != 4) return false;
  for (int i = 0; i < 2; ++i)
    if (shapes[1][i] != shapes[0][i] || shapes[2][i] != shapes[0][i]) return false;
  const int64_t rows = shapes[0][2], d = shapes[0][3], kl = shapes[1][2];
  if (shapes[1][3] != d || shapes[2][2] != kl || shapes[2][3] != d || kl == 0) return false;
  p->g_per_batch = shapes[0][1];
  p->rows = rows;
  p->kl = kl;
  p->d = d;
  p->nb = 1;
  p->c = rows;
  const int nd = ndims[bias_at];
  const int64_t *bs = shapes[bias_at];
  p->bias = nullptr;
  if (nd == 3 && bs[2] == kl && bs[1] > 0 && rows % bs[1] == 0) {
    if (bs[0] != 1 && bs[0] != shapes[0][0]) return false;
    p->nb = bs[0];
    p->c = bs[1];
    p->bias = static_cast<const float *>(params[bias_at]);
  }
  p->q = static_cast<const float *>(params[0]);
  p->k = static_cast<const float *>(params[1]);
  p->v = static_cast<const float *>(params[2]);
  const int64_t big = int64_t(1) << 31;
  return rows < big && kl < big && d < big;
}

// s = scale * s + bias for one row (in place); returns its max.
inline float scale_bias_row(float *s, const float *bias, int64_t n, float scale) {
  float hi = -INFINITY;
  if (bias) {
#pragma omp simd reduction(max : hi)
    for (int64_t j = 0; j < n; ++j) {
      s[j] = scale * s[j] + bias[j];
      hi = s[j] > hi ? s[j] : hi;
    }
  } else {
#pragma omp simd reduction(max : hi)
    for (int64_t j = 0; j < n; ++j) {
      s[j] *= scale;
      hi = s[j] > hi ? s[j] : hi;
    }
  }
  return hi;
}

void fwd_slice(const Pair &a, int64_t g, float *o, float *lse, float *sb) {
  const int64_t kl = a.kl, d = a.d;
  const float *qg = a.q + g * a.rows * d, *kg = a.k + g * kl * d, *vg = a.v + g * kl * d;
  float *og = o + g * a.rows * d, *lg = lse + g * a.rows;
  for (int64_t r0 = 0; r0 < a.rows; r0 += kRows) {
    const int64_t n = r0 + kRows < a.rows ? kRows : a.rows - r0;
    gemm_ld(false, true, n, kl, d, qg + r0 * d, d, kg, d, 0.f, sb, kl);  // q k^T
    std::vector<float> inv(static_cast<size_t>(n));
    for (int64_t j = 0; j < n; ++j) {
      float *s = sb + j * kl;
      const float hi = scale_bias_row(s, a.bias_row(g, r0 + j), kl, a.scale);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < kl; ++t) {
        s[t] = exp0(s[t] - hi);
        sum += s[t];
      }
      inv[j] = 1.0f / sum;
      lg[r0 + j] = hi + std::log(sum);
    }
    gemm_ld(false, false, n, d, kl, sb, kl, vg, d, 0.f, og + r0 * d, d);  // p v
    for (int64_t j = 0; j < n; ++j) {
      float *row = og + (r0 + j) * d;
      const float f = inv[j];
#pragma omp simd
      for (int64_t t = 0; t < d; ++t) row[t] *= f;
    }
  }
}

// dk / dv of the slice are zeroed here and accumulated over the row blocks.
void bwd_slice(const Pair &a, int64_t g, const float *dout, const float *delta, const float *lse, float *dq,
               float *dk, float *dv, float *sb, float *dpb) {
  const int64_t kl = a.kl, d = a.d;
  const float *qg = a.q + g * a.rows * d, *kg = a.k + g * kl * d, *vg = a.v + g * kl * d;
  const float *dog = dout + g * a.rows * d, *lg = lse + g * a.rows, *dg = delta + g * a.rows;
  float *dkg = dk + g * kl * d, *dvg = dv + g * kl * d;
  std::memset(dkg, 0, sizeof(float) * kl * d);
  std::memset(dvg, 0, sizeof(float) * kl * d);
  for (int64_t r0 = 0; r0 < a.rows; r0 += kRows) {
    const int64_t n = r0 + kRows < a.rows ? kRows : a.rows - r0;
    gemm_ld(false, true, n, kl, d, qg + r0 * d, d, kg, d, 0.f, sb, kl);       // q k^T
    gemm_ld(false, true, n, kl, d, dog + r0 * d, d, vg, d, 0.f, dpb, kl);     // dP = do v^T
    for (int64_t j = 0; j < n; ++j) {
      float *s = sb + j * kl, *dp = dpb + j * kl;
      scale_bias_row(s, a.bias_row(g, r0 + j), kl, a.scale);
      const float l = lg[r0 + j], dl = dg[r0 + j];
#pragma omp simd
      for (int64_t t = 0; t < kl; ++t) {
        const float p = exp0(s[t] - l);
        s[t] = p;
        dp[t] = a.scale * p * (dp[t] - dl);
      }
    }
    gemm_ld(true, false, kl, d, n, sb, kl, dog + r0 * d, d, 1.f, dvg, d);     // dv += p^T do
    gemm_ld(false, false, n, d, kl, dpb, kl, kg, d, 0.f, dq + (g * a.rows + r0) * d, d);  // dq = ds k
    gemm_ld(true, false, kl, d, n, dpb, kl, qg + r0 * d, d, 1.f, dkg, d);     // dk += ds^T q
  }
}

bool all_f32(const char **dtypes, std::initializer_list<int> idx) {
  for (int i : idx)
    if (!is_f32(dtypes[i])) return false;
  return true;
}

}  // namespace

MSLLM_EXPORT int PairAttnFwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                             void *) {
  if (nparam != 7) return kErrNParam;
  if (!all_f32(dtypes, {0, 1, 2, 3, 5, 6})) return kErrDtype;
  Pair a{};
  if (!read_pair(params, ndims, shapes, 3, &a)) return kErrShape;
  double scale;
  if (!read_scalar(params[4], dtypes[4], &scale)) return kErrDtype;
  const int64_t slices = shapes[0][0] * shapes[0][1];
  if (numel(ndims[5], shapes[5]) != slices * a.rows * a.d || numel(ndims[6], shapes[6]) != slices * a.rows)
    return kErrShape;
  a.scale = static_cast<float>(scale);
  float *o = static_cast<float *>(params[5]);
  float *lse = static_cast<float *>(params[6]);
  for_slices(slices, [&a, o, lse](int64_t first, int64_t last) {
    std::vector<float> sb(static_cast<size_t>(kRows * a.kl));
    for (int64_t g = first; g < last; ++g) fwd_slice(a, g, o, lse, sb.data());
  });
  return 0;
}

MSLLM_EXPORT int PairAttnBwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                             void *) {
  if (nparam != 11) return kErrNParam;
  if (!all_f32(dtypes, {0, 1, 2, 3, 4, 5, 6, 8, 9, 10})) return kErrDtype;
  Pair a{};
  if (!read_pair(params, ndims, shapes, 6, &a)) return kErrShape;
  double scale;
  if (!read_scalar(params[7], dtypes[7], &scale)) return kErrDtype;
  const int64_t slices = shapes[0][0] * shapes[0][1];
  const int64_t nq = slices * a.rows * a.d, nk = slices * a.kl * a.d;
  if (numel(ndims[3], shapes[3]) != nq || numel(ndims[4], shapes[4]) != slices * a.rows ||
      numel(ndims[5], shapes[5]) != slices * a.rows || numel(ndims[8], shapes[8]) != nq ||
      numel(ndims[9], shapes[9]) != nk || numel(ndims[10], shapes[10]) != nk)
    return kErrShape;
  a.scale = static_cast<float>(scale);
  const float *dout = static_cast<const float *>(params[3]);
  const float *delta = static_cast<const float *>(params[4]);
  const float *lse = static_cast<const float *>(params[5]);
  float *dq = static_cast<float *>(params[8]);
  float *dk = static_cast<float *>(params[9]);
  float *dv = static_cast<float *>(params[10]);
  for_slices(slices, [&](int64_t first, int64_t last) {
    std::vector<float> sb(static_cast<size_t>(kRows * a.kl)), dpb(sb.size());
    for (int64_t g = first; g < last; ++g) bwd_slice(a, g, dout, delta, lse, dq, dk, dv, sb.data(), dpb.data());
  });
  return 0;
}

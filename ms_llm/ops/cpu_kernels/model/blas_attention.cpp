// Causal attention with causal block skipping, on OpenBLAS sgemm (part of libmsllm_blas_kernels.so,
// see blas_kernels.cpp for the build and the calling convention).
//
// Why: the composed form multiplies the full [s, s] score matrix and then masks half of it away;
// here the queries are cut into blocks of kBlock rows and block [q0, q1) multiplies only the keys
// [0, q1) it can see, in forward (scores, probs @ V) and backward (dP, dQ, dK, dV), so the GEMM work
// is (n + 1) / 2n of the full product for n blocks (56 % at s = 512). The R query heads of a KV
// group are multiplied together (their block rows gathered query-major into a scratch matrix), so
// each GEMM has R * kBlock rows: many small GEMMs thread badly in OpenBLAS. The probabilities are an
// output (the backward's saved tensor, as in the composed form), stored query-major
// ([.., S, R, S]: rows i*R + h) for the same reason; masked entries are exactly 0.
//
// Layout (the grouped-query layout of ops/attention.py, no K/V expansion):
//   q [B, G, R*S, D] fp32, rows h*S + i (h < R query heads of KV group g, i < S positions)
//   k, v [B, G, S, D] fp32;  scale: 0-d scalar
//   CausalAttnFwd: (q, k, v, scale) -> (o [B, G, R*S, D], p [B, G, S*R, S] query-major)
//   CausalAttnBwd: (q, k, v, p, do, scale) -> (dq, dk, dv)
// Softmax statistics are fp32 (max-subtracted exp, the Cephes exp_f of cpu_math.h).
//
// Threads: the (batch x KV group) slices are independent, so with T = OpenBLAS's thread count > 1
// they are split over T std::threads, each running single-threaded GEMMs (``for_slices``,
// blas_gemm.h).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "blas_gemm.h"
#include "cpu_math.h"

#define MSLLM_EXPORT extern "C" __attribute__((visibility("default")))

using namespace msllm;

namespace {

constexpr int64_t kBlock = 64;  // query rows per block; see benchmarks/attention.py

struct Dims {
  int64_t bg, r, s, d;
};

// q [.., R*S, D] and k [.., S, D] with equal leading dims; returns false on a mismatch.
bool attn_dims(int *ndims, int64_t **shapes, Dims *dm) {
  const int nq = ndims[0], nk = ndims[1];
  if (nq < 2 || nk != nq || ndims[2] != nq) return false;
  int64_t bg = 1;
  for (int i = 0; i < nq - 2; ++i) {
    if (shapes[0][i] != shapes[1][i] || shapes[2][i] != shapes[1][i]) return false;
    bg *= shapes[0][i];
  }
  const int64_t s = shapes[1][nk - 2], d = shapes[1][nk - 1];
  if (s == 0 || shapes[0][nq - 1] != d || shapes[2][nq - 1] != d || shapes[2][nq - 2] != s) return false;
  if (shapes[0][nq - 2] % s) return false;
  *dm = {bg, shapes[0][nq - 2] / s, s, d};
  return true;
}

// One score row (query position i sees keys [0, len)) -> softmax(scale * row) in place, zeros
// from len to width.
void softmax_row(float *row, int64_t len, int64_t width, float scale) {
  float hi = -INFINITY, lo = INFINITY;
#pragma omp simd reduction(max : hi) reduction(min : lo)
  for (int64_t j = 0; j < len; ++j) {
    hi = row[j] > hi ? row[j] : hi;
    lo = row[j] < lo ? row[j] : lo;
  }
  const float shift = scale >= 0.f ? scale * hi : scale * lo;  // max_j scale * row[j]
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < len; ++j) {
    const float e = exp_f(scale * row[j] - shift);
    row[j] = e;
    sum += e;
  }
  const float inv = 1.0f / sum;
#pragma omp simd
  for (int64_t j = 0; j < len; ++j) row[j] *= inv;
  if (len < width) std::memset(row + len, 0, sizeof(float) * (width - len));
}

// Rows (h*S + i) for i in [q0, q1), h < R of x [R*S, D] <-> rows ((i - q0)*R + h) of y [m*R, D].
void gather_rows(const float *x, float *y, int64_t r, int64_t s, int64_t d, int64_t q0, int64_t q1) {
  for (int64_t i = q0; i < q1; ++i)
    for (int64_t h = 0; h < r; ++h) std::memcpy(y + ((i - q0) * r + h) * d, x + (h * s + i) * d, sizeof(float) * d);
}

void scatter_rows(const float *y, float *x, int64_t r, int64_t s, int64_t d, int64_t q0, int64_t q1) {
  for (int64_t i = q0; i < q1; ++i)
    for (int64_t h = 0; h < r; ++h) std::memcpy(x + (h * s + i) * d, y + ((i - q0) * r + h) * d, sizeof(float) * d);
}

struct Attn {
  const float *q, *k, *v;
  int64_t r, s, d;
  float scale;
};

// Forward of one (batch, KV group) slice g; qs, os: scratch of kBlock * r * d floats.
void fwd_slice(const Attn &a, int64_t g, float *o, float *p, float *qs, float *os) {
  const int64_t r = a.r, s = a.s, d = a.d;
  const float *kg = a.k + g * s * d, *vg = a.v + g * s * d, *qg = a.q + g * r * s * d;
  for (int64_t q0 = 0; q0 < s; q0 += kBlock) {
    const int64_t q1 = q0 + kBlock < s ? q0 + kBlock : s, rows = (q1 - q0) * r;
    float *pb = p + (g * s + q0) * r * s;  // rows (i, h), i in [q0, q1)
    gather_rows(qg, qs, r, s, d, q0, q1);
    gemm_ld(false, true, rows, q1, d, qs, d, kg, d, 0.f, pb, s);  // scores [rows, q1]
    for (int64_t j = 0; j < rows; ++j) softmax_row(pb + j * s, q0 + j / r + 1, s, a.scale);
    gemm_ld(false, false, rows, d, q1, pb, s, vg, d, 0.f, os, d);  // P V
    scatter_rows(os, o + g * r * s * d, r, s, d, q0, q1);
  }
}

// Backward of slice g: dq rows of the slice, dk / dv of the slice (zeroed here).
void bwd_slice(const Attn &a, int64_t g, const float *p, const float *dout, float *dq, float *dk, float *dv,
               float *qs, float *dos, float *dqs, float *ds) {
  const int64_t r = a.r, s = a.s, d = a.d;
  const float *kg = a.k + g * s * d, *vg = a.v + g * s * d;
  float *dkg = dk + g * s * d, *dvg = dv + g * s * d;
  std::memset(dkg, 0, sizeof(float) * s * d);
  std::memset(dvg, 0, sizeof(float) * s * d);
  for (int64_t q0 = 0; q0 < s; q0 += kBlock) {
    const int64_t q1 = q0 + kBlock < s ? q0 + kBlock : s, rows = (q1 - q0) * r;
    const float *pb = p + (g * s + q0) * r * s;
    gather_rows(a.q + g * r * s * d, qs, r, s, d, q0, q1);
    gather_rows(dout + g * r * s * d, dos, r, s, d, q0, q1);
    gemm_ld(true, false, q1, d, rows, pb, s, dos, d, 1.f, dvg, d);  // dV[0:q1] += P^T dO
    gemm_ld(false, true, rows, q1, d, dos, d, vg, d, 0.f, ds, s);   // dP = dO V^T  [rows, q1]
    for (int64_t j = 0; j < rows; ++j) {                            // dS = scale P (dP - <dP, P>)
      const int64_t len = q0 + j / r + 1;
      const float *pr = pb + j * s;
      float *dr = ds + j * s;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t c = 0; c < len; ++c) dot += dr[c] * pr[c];
#pragma omp simd
      for (int64_t c = 0; c < len; ++c) dr[c] = a.scale * pr[c] * (dr[c] - dot);
      if (len < q1) std::memset(dr + len, 0, sizeof(float) * (q1 - len));
    }
    gemm_ld(false, false, rows, d, q1, ds, s, kg, d, 0.f, dqs, d);  // dQ = dS K
    gemm_ld(true, false, q1, d, rows, ds, s, qs, d, 1.f, dkg, d);   // dK += dS^T Q
    scatter_rows(dqs, dq + g * r * s * d, r, s, d, q0, q1);
  }
}

}  // namespace

MSLLM_EXPORT int CausalAttnFwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                               void *) {
  if (nparam != 6) return kErrNParam;
  for (int i : {0, 1, 2, 4, 5})
    if (!is_f32(dtypes[i])) return kErrDtype;
  Dims dm;
  if (!attn_dims(ndims, shapes, &dm)) return kErrShape;
  double scale_d;
  if (!read_scalar(params[3], dtypes[3], &scale_d)) return kErrDtype;
  const float scale = static_cast<float>(scale_d);
  const int64_t bg = dm.bg, r = dm.r, s = dm.s, d = dm.d;
  if (numel(ndims[4], shapes[4]) != bg * r * s * d || numel(ndims[5], shapes[5]) != bg * r * s * s)
    return kErrShape;
  if (r * s >= (int64_t(1) << 31) || d >= (int64_t(1) << 31)) return kErrTooLarge;
  const Attn a{static_cast<const float *>(params[0]), static_cast<const float *>(params[1]),
               static_cast<const float *>(params[2]), r, s, d, scale};
  float *o = static_cast<float *>(params[4]);
  float *p = static_cast<float *>(params[5]);
  for_slices(bg, [&a, o, p](int64_t first, int64_t last) {
    std::vector<float> qs(static_cast<size_t>(kBlock * a.r * a.d)), os(qs.size());
    for (int64_t g = first; g < last; ++g) fwd_slice(a, g, o, p, qs.data(), os.data());
  });
  return 0;
}

MSLLM_EXPORT int CausalAttnBwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                               void *) {
  if (nparam != 9) return kErrNParam;
  for (int i : {0, 1, 2, 3, 4, 6, 7, 8})
    if (!is_f32(dtypes[i])) return kErrDtype;
  Dims dm;
  if (!attn_dims(ndims, shapes, &dm)) return kErrShape;
  double scale_d;
  if (!read_scalar(params[5], dtypes[5], &scale_d)) return kErrDtype;
  const float scale = static_cast<float>(scale_d);
  const int64_t bg = dm.bg, r = dm.r, s = dm.s, d = dm.d;
  const int64_t nq = bg * r * s * d, nk = bg * s * d;
  if (numel(ndims[3], shapes[3]) != bg * r * s * s || numel(ndims[4], shapes[4]) != nq ||
      numel(ndims[6], shapes[6]) != nq || numel(ndims[7], shapes[7]) != nk || numel(ndims[8], shapes[8]) != nk)
    return kErrShape;
  const Attn a{static_cast<const float *>(params[0]), static_cast<const float *>(params[1]),
               static_cast<const float *>(params[2]), r, s, d, scale};
  const float *p = static_cast<const float *>(params[3]);
  const float *dout = static_cast<const float *>(params[4]);
  float *dq = static_cast<float *>(params[6]);
  float *dk = static_cast<float *>(params[7]);
  float *dv = static_cast<float *>(params[8]);
  for_slices(bg, [&](int64_t first, int64_t last) {
    const size_t blk = static_cast<size_t>(kBlock * a.r);
    std::vector<float> qs(blk * a.d), dos(blk * a.d), dqs(blk * a.d), ds(blk * a.s);
    for (int64_t g = first; g < last; ++g)
      bwd_slice(a, g, p, dout, dq, dk, dv, qs.data(), dos.data(), dqs.data(), ds.data());
  });
  return 0;
}

// One-token decode steps of a transformer layer, fused (part of libmsllm_blas_kernels.so, see
// blas_kernels.cpp for the build and the calling convention).
//
// Why: a PyNative decode step of one dense layer dispatched ~30 MindSpore ops (13 of them AOT
// custom calls at ~100-200 us of dispatch each), while its arithmetic for a small model is a few
// matrix-vector products: dispatch, not FLOPs, set the token rate. Here the layer is two calls:
//
//   DecodeAttnBlock: out = x + proj(attention(rope(qk_norm(split(qkv(rms_norm(x)))))), writing the
//     new K/V into the preallocated cache in place and attending over the filled slots only;
//   DecodeMlpBlock:  out = x + fc2(swiglu(fc1(rms_norm(x)))).
//
// They compute what ms_llm.models.layers.TransformerLayer computes (tested against it), in fp32.
//
// DecodeAttnBlock(x [B,1,H], w_norm [H], w_qkv [W,H], b_qkv [W|1], q_norm [D|1], k_norm [D|1],
//                 w_proj [H,NH*D], b_proj [H|1], cos [1|B, ROT], sin, k_cache [B,G,C,D],
//                 v_cache [B,G,C,D], mask [MB,1,1,C] bool (True = hidden), icfg int64 [8],
//                 fcfg fp32 [3], pos int64 [1]) -> out [B,1,H]
//   pos: the slot written (= the cache length before this token), one tensor shared by the layers
//   icfg: unused, r (query heads per KV group),
//         gated (Qwen3-Next output gate rows), has_qkv_bias, has_qk_norm, has_proj_bias,
//         norm_offset (1: zero-centred norms scale by 1 + w), rot (rotated dims of each head)
//   fcfg: eps (every RMSNorm of the layer), scale (softmax scale), unused
//   QKV rows per group g (G = W / ((r*(1+gated)+2) D)): [q (r D) | gate (r D) | k (D) | v (D)].
//   The cache inputs are written at slot pos (an in-place side effect MindSpore does not see:
//   PyNative only, the caller owns the buffers).
//
// DecodeMlpBlock(x [B,1,H], w_norm [H], w_fc1 [2F,H], b_fc1 [2F|1], w_fc2 [H,F], b_fc2 [H|1],
//                icfg int64 [3] (has_b1, has_b2, norm_offset), fcfg fp32 [1] (eps)) -> out [B,1,H]
//
// Threads: OpenBLAS's pool for the weight products (generate runs them on one thread).

#include <cblas.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_math.h"

#define MSLLM_EXPORT extern "C" __attribute__((visibility("default")))

using namespace msllm;

namespace {

// y [m, n] = x [m, k] w[n, k]^T (+ bias [n]).
void matmul_wt(const float *x, const float *w, const float *bias, float *y, int64_t m, int64_t n,
               int64_t k) {
  if (m == 1) {
    scipy_cblas_sgemv(CblasRowMajor, CblasNoTrans, static_cast<blasint>(n), static_cast<blasint>(k), 1.0f, w,
                      static_cast<blasint>(k), x, 1, 0.0f, y, 1);
  } else {
    scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(m), static_cast<blasint>(n),
                      static_cast<blasint>(k), 1.0f, x, static_cast<blasint>(k), w, static_cast<blasint>(k), 0.0f, y,
                      static_cast<blasint>(n));
  }
  if (bias != nullptr)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) y[i * n + j] += bias[j];
}

// y = x * rsqrt(mean(x^2) + eps) * (w + offset), fp32 statistics as ops/rms_norm.py.
void rms_norm(const float *x, const float *w, float offset, float eps, float *y, int64_t n) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * inv * (w[i] + offset);
}

// Rotate-half RoPE of the first rot dims of v [d] in place (the rest passes through).
void rope(float *v, const float *cos, const float *sin, int64_t rot) {
  const int64_t half = rot / 2;
  float tmp[1024];
  for (int64_t j = 0; j < rot; ++j) {
    const float rh = j < half ? -v[j + half] : v[j - half];
    tmp[j] = v[j] * cos[j] + rh * sin[j];
  }
  std::memcpy(v, tmp, sizeof(float) * rot);
}

bool f32_all(const char **dtypes, std::initializer_list<int> idx) {
  for (int i : idx)
    if (!is_f32(dtypes[i])) return false;
  return true;
}

}  // namespace

MSLLM_EXPORT int DecodeAttnBlock(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                 void *, void *) {
  if (nparam != 17) return kErrNParam;
  if (!f32_all(dtypes, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 14, 16}) || !is_i64(dtypes[13]) || !is_i64(dtypes[15]) ||
      std::strcmp(dtypes[12], "bool") != 0)
    return kErrDtype;
  if (ndims[0] != 3 || shapes[0][1] != 1 || ndims[10] != 4 || ndims[12] != 4) return kErrShape;
  const int64_t *ic = static_cast<const int64_t *>(params[13]);
  const float *fc = static_cast<const float *>(params[14]);
  const int64_t pos = *static_cast<const int64_t *>(params[15]), r = ic[1], gated = ic[2], rot = ic[7];
  const bool qkv_bias = ic[3] != 0, qk_norm = ic[4] != 0, proj_bias = ic[5] != 0;
  const float offset = ic[6] ? 1.0f : 0.0f, eps = fc[0], scale = fc[1];
  const int64_t b = shapes[0][0], h = shapes[0][2];
  const int64_t g = shapes[10][1], cap = shapes[10][2], d = shapes[10][3];
  const int64_t rq = gated ? 2 * r : r, width = shapes[2][0], nh = g * r;
  if (shapes[10][0] != b || width != g * (rq + 2) * d || shapes[2][1] != h || numel(ndims[6], shapes[6]) != h * nh * d ||
      numel(ndims[11], shapes[11]) != b * g * cap * d || pos < 0 || pos >= cap || rot > d || rot % 2 ||
      rot > 1024 || shapes[12][3] != cap || (shapes[12][0] != 1 && shapes[12][0] != b))
    return kErrShape;
  const int64_t ncos = numel(ndims[8], shapes[8]);
  if (ncos != rot && ncos != b * rot) return kErrShape;
  if (numel(ndims[16], shapes[16]) != b * h) return kErrShape;
  const float *x = static_cast<const float *>(params[0]);
  const float *w_norm = static_cast<const float *>(params[1]);
  const float *w_qkv = static_cast<const float *>(params[2]);
  const float *b_qkv = qkv_bias ? static_cast<const float *>(params[3]) : nullptr;
  const float *qn = static_cast<const float *>(params[4]);
  const float *kn = static_cast<const float *>(params[5]);
  const float *w_proj = static_cast<const float *>(params[6]);
  const float *b_proj = proj_bias ? static_cast<const float *>(params[7]) : nullptr;
  const float *cs = static_cast<const float *>(params[8]);
  const float *sn = static_cast<const float *>(params[9]);
  float *kc = static_cast<float *>(params[10]);
  float *vc = static_cast<float *>(params[11]);
  const bool *mask = static_cast<const bool *>(params[12]);
  float *out = static_cast<float *>(params[16]);

  std::vector<float> xn(b * h), qkv(b * width), attn(b * nh * d), scores(r * (pos + 1));
  for (int64_t i = 0; i < b; ++i) rms_norm(x + i * h, w_norm, offset, eps, xn.data() + i * h, h);
  matmul_wt(xn.data(), w_qkv, b_qkv, qkv.data(), b, width, h);
  const int64_t kmax = pos + 1;
  for (int64_t i = 0; i < b; ++i) {
    const float *ci = ncos == rot ? cs : cs + i * rot, *si = ncos == rot ? sn : sn + i * rot;
    const bool *mi = mask + (shapes[12][0] == 1 ? 0 : i) * cap;
    for (int64_t gi = 0; gi < g; ++gi) {
      float *row = qkv.data() + i * width + gi * (rq + 2) * d;
      float *q = row, *gate = row + r * d, *k = row + rq * d, *v = k + d;
      for (int64_t hq = 0; hq < r; ++hq) {
        if (qk_norm) rms_norm(q + hq * d, qn, offset, eps, q + hq * d, d);
        rope(q + hq * d, ci, si, rot);
      }
      if (qk_norm) rms_norm(k, kn, offset, eps, k, d);
      rope(k, ci, si, rot);
      float *kg = kc + (i * g + gi) * cap * d, *vg = vc + (i * g + gi) * cap * d;
      std::memcpy(kg + pos * d, k, sizeof(float) * d);
      std::memcpy(vg + pos * d, v, sizeof(float) * d);
      // scores [r, kmax] = q [r, d] K[:kmax]^T; masked softmax; o [r, d] = P V[:kmax]
      scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(r),
                        static_cast<blasint>(kmax), static_cast<blasint>(d), scale, q, static_cast<blasint>(d), kg,
                        static_cast<blasint>(d), 0.0f, scores.data(), static_cast<blasint>(kmax));
      for (int64_t hq = 0; hq < r; ++hq) {
        float *sr = scores.data() + hq * kmax;
        float hi = -INFINITY;
        for (int64_t j = 0; j < kmax; ++j)
          if (!mi[j] && sr[j] > hi) hi = sr[j];
        float sum = 0.f;
        for (int64_t j = 0; j < kmax; ++j) {
          const float e = mi[j] ? 0.f : exp_f(sr[j] - hi);
          sr[j] = e;
          sum += e;
        }
        const float inv = sum > 0.f ? 1.0f / sum : 0.f;  // every slot hidden: zeros
        for (int64_t j = 0; j < kmax; ++j) sr[j] *= inv;
      }
      float *o = attn.data() + (i * nh + gi * r) * d;
      scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<blasint>(r), static_cast<blasint>(d),
                        static_cast<blasint>(kmax), 1.0f, scores.data(), static_cast<blasint>(kmax), vg,
                        static_cast<blasint>(d), 0.0f, o, static_cast<blasint>(d));
      if (gated)
        for (int64_t j = 0; j < r * d; ++j) o[j] *= 1.0f / (1.0f + std::exp(-gate[j]));
    }
  }
  matmul_wt(attn.data(), w_proj, b_proj, out, b, h, nh * d);
  for (int64_t j = 0; j < b * h; ++j) out[j] += x[j];
  return 0;
}

MSLLM_EXPORT int DecodeMlpBlock(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                                void *) {
  if (nparam != 9) return kErrNParam;
  if (!f32_all(dtypes, {0, 1, 2, 3, 4, 5, 7, 8}) || !is_i64(dtypes[6])) return kErrDtype;
  const int64_t *ic = static_cast<const int64_t *>(params[6]);
  const float eps = static_cast<const float *>(params[7])[0];
  const float offset = ic[2] ? 1.0f : 0.0f;
  const int64_t h = shapes[0][ndims[0] - 1], m = numel(ndims[0], shapes[0]) / h;
  const int64_t f2 = shapes[2][0], f = f2 / 2;
  if (ndims[2] != 2 || shapes[2][1] != h || f2 % 2 || numel(ndims[4], shapes[4]) != h * f ||
      numel(ndims[8], shapes[8]) != m * h)
    return kErrShape;
  const float *x = static_cast<const float *>(params[0]);
  const float *w_norm = static_cast<const float *>(params[1]);
  const float *b1 = ic[0] ? static_cast<const float *>(params[3]) : nullptr;
  const float *b2 = ic[1] ? static_cast<const float *>(params[5]) : nullptr;
  float *out = static_cast<float *>(params[8]);
  std::vector<float> xn(m * h), hid(m * f2), act(m * f);
  for (int64_t i = 0; i < m; ++i) rms_norm(x + i * h, w_norm, offset, eps, xn.data() + i * h, h);
  matmul_wt(xn.data(), static_cast<const float *>(params[2]), b1, hid.data(), m, f2, h);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < f; ++j) {
      const float gv = hid[i * f2 + j];
      act[i * f + j] = gv / (1.0f + std::exp(-gv)) * hid[i * f2 + f + j];
    }
  matmul_wt(act.data(), static_cast<const float *>(params[4]), b2, out, m, h, f);
  for (int64_t j = 0; j < m * h; ++j) out[j] += x[j];
  return 0;
}

// CacheAttnFwd(q [B,G,R*S,D], k [B,G,C,D], v [B,G,C,DV], mask [MB,1,S,C] bool (True = hidden),
//              scale fp32 [1]) -> o [B,G,R*S,DV]
// Attention of S new queries (rows h*S + i, the grouped layout of ops/attention.py) over a whole
// cache buffer, in one call instead of a matmul / mask / softmax / matmul chain; columns past the
// last visible one of a batch row are never read (the unfilled slots). A row that sees nothing
// gets zeros (the composed form's uniform average of masked slots is never used either).
MSLLM_EXPORT int CacheAttnFwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                              void *) {
  if (nparam != 6) return kErrNParam;
  if (!f32_all(dtypes, {0, 1, 2, 4, 5}) || std::strcmp(dtypes[3], "bool") != 0) return kErrDtype;
  if (ndims[0] != 4 || ndims[1] != 4 || ndims[2] != 4 || ndims[3] != 4) return kErrShape;
  const int64_t b = shapes[1][0], g = shapes[1][1], cap = shapes[1][2], d = shapes[1][3], dv = shapes[2][3];
  const int64_t s = shapes[3][2], mb = shapes[3][0];
  if (shapes[0][0] != b || shapes[0][1] != g || shapes[0][3] != d || shapes[0][2] % s || shapes[2][0] != b ||
      shapes[2][1] != g || shapes[2][2] != cap || shapes[3][3] != cap || (mb != 1 && mb != b))
    return kErrShape;
  const int64_t r = shapes[0][2] / s;
  const float *q = static_cast<const float *>(params[0]);
  const float *k = static_cast<const float *>(params[1]);
  const float *v = static_cast<const float *>(params[2]);
  const bool *mask = static_cast<const bool *>(params[3]);
  const float scale = static_cast<const float *>(params[4])[0];
  float *o = static_cast<float *>(params[5]);
  std::vector<float> scores;
  for (int64_t i = 0; i < b; ++i) {
    const bool *mi = mask + (mb == 1 ? 0 : i) * s * cap;
    int64_t kmax = 0;
    for (int64_t j = 0; j < s * cap; ++j)
      if (!mi[j] && j % cap + 1 > kmax) kmax = j % cap + 1;
    for (int64_t gi = 0; gi < g; ++gi) {
      const float *qg = q + (i * g + gi) * r * s * d;
      const float *kg = k + (i * g + gi) * cap * d, *vg = v + (i * g + gi) * cap * dv;
      float *og = o + (i * g + gi) * r * s * dv;
      if (kmax == 0) {
        std::memset(og, 0, sizeof(float) * r * s * dv);
        continue;
      }
      scores.resize(r * s * kmax);
      scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(r * s),
                        static_cast<blasint>(kmax), static_cast<blasint>(d), scale, qg, static_cast<blasint>(d), kg,
                        static_cast<blasint>(d), 0.0f, scores.data(), static_cast<blasint>(kmax));
      for (int64_t row = 0; row < r * s; ++row) {
        const bool *mr = mi + (row % s) * cap;
        float *sr = scores.data() + row * kmax;
        float hi = -INFINITY;
        for (int64_t j = 0; j < kmax; ++j)
          if (!mr[j] && sr[j] > hi) hi = sr[j];
        float sum = 0.f;
        for (int64_t j = 0; j < kmax; ++j) {
          const float e = mr[j] ? 0.f : exp_f(sr[j] - hi);
          sr[j] = e;
          sum += e;
        }
        const float inv = sum > 0.f ? 1.0f / sum : 0.f;
        for (int64_t j = 0; j < kmax; ++j) sr[j] *= inv;
      }
      scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<blasint>(r * s),
                        static_cast<blasint>(dv), static_cast<blasint>(kmax), 1.0f, scores.data(),
                        static_cast<blasint>(kmax), vg, static_cast<blasint>(dv), 0.0f, og, static_cast<blasint>(dv));
    }
  }
  return 0;
}

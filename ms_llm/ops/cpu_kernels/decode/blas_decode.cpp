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
// Threads: the calling thread (generate keeps OpenBLAS at one thread); the code is blas_decode.h's,
// which the whole-model step (blas_decode_model.cpp) shares.

#include <cstring>
#include <vector>

#include "blas_decode.h"

#define MSLLM_EXPORT extern "C" __attribute__((visibility("default")))

using namespace msllm;
using namespace msllm_decode;

namespace {

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
  const int64_t b = shapes[0][0], h = shapes[0][2];
  const int64_t g = shapes[10][1], cap = shapes[10][2], d = shapes[10][3];
  const int64_t rq = gated ? 2 * r : r, width = shapes[2][0], nh = g * r;
  if (shapes[10][0] != b || width != g * (rq + 2) * d || shapes[2][1] != h || numel(ndims[6], shapes[6]) != h * nh * d ||
      numel(ndims[11], shapes[11]) != b * g * cap * d || pos < 0 || pos >= cap || rot > d || rot % 2 ||
      rot > 1024 || r > 64 || r < 1 || shapes[12][3] != cap || (shapes[12][0] != 1 && shapes[12][0] != b))
    return kErrShape;
  const int64_t ncos = numel(ndims[8], shapes[8]);
  if (ncos != rot && ncos != b * rot) return kErrShape;
  if (numel(ndims[16], shapes[16]) != b * h) return kErrShape;
  auto f = [&](int i) { return static_cast<const float *>(params[i]); };
  const AttnLayer L{f(1), f(2), ic[3] ? f(3) : nullptr, ic[4] ? f(4) : nullptr, ic[4] ? f(5) : nullptr, f(6),
                    ic[5] ? f(7) : nullptr, r, g, d, rot, gated != 0, ic[6] ? 1.0f : 0.0f, fc[0], fc[1]};
  const AttnStep S{f(8), f(9), ncos == rot ? 0 : rot, static_cast<const bool *>(params[12]),
                   shapes[12][0] == 1 ? 0 : cap, static_cast<float *>(params[10]), static_cast<float *>(params[11]),
                   cap, pos};
  attn_block(L, S, f(0), static_cast<float *>(params[16]), b, h, Par());
  return 0;
}

MSLLM_EXPORT int DecodeMlpBlock(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                                void *) {
  if (nparam != 9) return kErrNParam;
  if (!f32_all(dtypes, {0, 1, 2, 3, 4, 5, 7, 8}) || !is_i64(dtypes[6])) return kErrDtype;
  const int64_t *ic = static_cast<const int64_t *>(params[6]);
  const float eps = static_cast<const float *>(params[7])[0];
  const int64_t h = shapes[0][ndims[0] - 1], m = numel(ndims[0], shapes[0]) / h;
  const int64_t f2 = shapes[2][0], f = f2 / 2;
  if (ndims[2] != 2 || shapes[2][1] != h || f2 % 2 || numel(ndims[4], shapes[4]) != h * f ||
      numel(ndims[8], shapes[8]) != m * h)
    return kErrShape;
  auto p = [&](int i) { return static_cast<const float *>(params[i]); };
  const MlpLayer L{p(1), p(2), ic[0] ? p(3) : nullptr, p(4), ic[1] ? p(5) : nullptr, f, ic[2] ? 1.0f : 0.0f, eps};
  mlp_block(L, p(0), static_cast<float *>(params[8]), m, h, Par());
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

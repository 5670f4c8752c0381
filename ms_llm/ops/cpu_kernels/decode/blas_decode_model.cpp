// The whole model's one-token decode step as one plain C call (part of libmsllm_blas_kernels.so;
// called through ctypes by ms_llm.ops.cpu_kernels.decode.ModelStep, not through MindSpore).
//
// Why: with each layer fused into two AOT calls (blas_decode.cpp) a 6-layer step still dispatched
// 15 MindSpore ops (~0.1-0.2 ms each), built a mask and cos / sin tensors, copied [b, V] logits to
// the host and ran the LM head as a single-threaded product. Here one call does everything from
// the token ids to the next greedy tokens: embedding gather, every layer (attention half with the
// in-place cache write, SwiGLU MLP half), final RMSNorm, LM head, argmax; MindSpore dispatches
// nothing, and the large products and the attention over long caches use nt threads.
//
// DecodeModelStep(cfg int64 [17], fcfg fp32 [2], layers uint64 [L * 14], model uint64 [5],
//                 ids int64 [b], positions int64 [b], padding bool [b, pad_stride],
//                 logits fp32 [b, V] (out), tokens int64 [b] (out), seconds fp64 [4] (added to))
//                 -> 0, or 2 on bad input
//   seconds (for benchmarks/generate.py's breakdown): += the time in the attention halves but
//         their attention over the cache, in that attention, in the MLP halves, in the final
//         norm + LM head + argmax (the embedding gather is the rest of the call)
//   cfg:  L, b, H, V (head rows), nv (argmax over the first nv logits), r, g, d, F, rot,
//         cap (cache slots), gated, norm_offset (1: zero-centred norms), pos (the slot written),
//         pad_stride, nt (threads), min_macs (less work than this stays on one thread; 0: the default)
//   fcfg: eps (every RMSNorm), softmax scale
//   layers, per layer: input norm, qkv W, qkv bias, q norm, k norm, proj W, proj bias,
//         pre-MLP norm, fc1 W, fc1 bias, fc2 W, fc2 bias, K cache, V cache (addresses; 0 = absent)
//   model: embedding [V, H], final norm [H], head W [V, H], cos table, sin table ([rows, rot])
//   Row i uses RoPE position positions[i] and does not see slot j where padding[i, j].

#include <cstdint>
#include <vector>

#include "blas_decode.h"

#define MSLLM_EXPORT extern "C" __attribute__((visibility("default")))

using namespace msllm_decode;

MSLLM_EXPORT int DecodeModelStep(const int64_t *cfg, const float *fcfg, const uint64_t *layers, const uint64_t *model,
                                 const int64_t *ids, const int64_t *positions, const bool *padding, float *logits,
                                 int64_t *tokens, double *seconds) {
  const int64_t nl = cfg[0], b = cfg[1], h = cfg[2], vocab = cfg[3], nv = cfg[4], r = cfg[5], g = cfg[6], d = cfg[7];
  const int64_t f = cfg[8], rot = cfg[9], cap = cfg[10], pos = cfg[13], pad_stride = cfg[14];
  const bool gated = cfg[11] != 0;
  const float offset = cfg[12] ? 1.0f : 0.0f, eps = fcfg[0], scale = fcfg[1];
  Par par;
  par.nt = static_cast<int>(cfg[15]);
  if (cfg[16] > 0) par.min_macs = cfg[16];
  if (pos < 0 || pos >= cap || pos >= pad_stride || rot > d || rot % 2 || rot > 1024 || r > 64 || r < 1 || nv > vocab || b < 1)
    return msllm::kErrShape;
  auto fp = [](uint64_t a) { return reinterpret_cast<const float *>(a); };
  const float *emb = fp(model[0]), *final_norm = fp(model[1]), *head = fp(model[2]);
  std::vector<float> x(b * h), y(b * h), cs(b * rot), sn(b * rot);
  for (int64_t i = 0; i < b; ++i) {
    if (ids[i] < 0 || ids[i] >= vocab) return msllm::kErrShape;
    std::memcpy(x.data() + i * h, emb + ids[i] * h, sizeof(float) * h);
    std::memcpy(cs.data() + i * rot, fp(model[3]) + positions[i] * rot, sizeof(float) * rot);
    std::memcpy(sn.data() + i * rot, fp(model[4]) + positions[i] * rot, sizeof(float) * rot);
  }
  for (int64_t l = 0; l < nl; ++l) {
    const uint64_t *p = layers + l * 14;
    const AttnLayer A{fp(p[0]), fp(p[1]), fp(p[2]), fp(p[3]), fp(p[4]), fp(p[5]), fp(p[6]), r, g, d, rot,
                      gated, offset, eps, scale};
    const AttnStep S{cs.data(), sn.data(), rot, padding, pad_stride, reinterpret_cast<float *>(p[12]),
                     reinterpret_cast<float *>(p[13]), cap, pos, seconds + 1};
    const double t0 = now_seconds(), core0 = seconds[1];
    attn_block(A, S, x.data(), y.data(), b, h, par);
    const MlpLayer M{fp(p[7]), fp(p[8]), fp(p[9]), fp(p[10]), fp(p[11]), f, offset, eps};
    const double t1 = now_seconds();
    mlp_block(M, y.data(), x.data(), b, h, par);
    seconds[0] += (t1 - t0) - (seconds[1] - core0);
    seconds[2] += now_seconds() - t1;
  }
  const double t2 = now_seconds();
  for (int64_t i = 0; i < b; ++i) rms_norm(x.data() + i * h, final_norm, offset, eps, y.data() + i * h, h);
  matmul_wt(y.data(), head, nullptr, logits, b, vocab, h, par);
  if (nv > 0)
    for (int64_t i = 0; i < b; ++i) {  // the first index of the maximum, as numpy / torch argmax
      const float *li = logits + i * vocab;
      int64_t best = 0;
      for (int64_t j = 1; j < nv; ++j)
        if (li[j] > li[best]) best = j;
      tokens[i] = best;
    }
  seconds[3] += now_seconds() - t2;
  return 0;
}

// Muon's Newton-Schulz orthogonalisation as one CPU kernel (ops.Custom(func_type="aot")), called
// from newton_schulz.py. Built into libmsllm_blas_kernels.so with blas_kernels.cpp (see build.py).
//
// Why: in PyNative every Newton-Schulz step of every matrix was ~8 framework ops (three matmuls,
// scalings, identity adds), each a dispatch and a thread-pool wake-up, and every product a full
// GEMM. Here one call runs all steps of a batch of same-shape matrices back to back, and the two
// symmetric products are SYRK: the Gram matrix A = X X^T and A A (= A A^T, A symmetric) need half
// a GEMM's flops each. Per step, for X [k, N] (k the smaller side):
//     A = X X^T                (ssyrk, upper triangle, then mirrored)
//     B = b A + c A A + a I    (ssyrk of A, upper, then mirrored)
//     X = B X                  (sgemm)
// A tall X [m, n] (m > n) is iterated as its transpose without copying: A = X^T X (ssyrk Trans)
// and X = X B (B symmetric), the same numbers as transposing in and out.
//
// bf16 (opt-in, training.muon_ns_dtype bf16): the GEMM operands are rounded to bf16 and multiplied
// by a registered bf16 x bf16 -> fp32 GEMM (oneDNN's dnnl_gemm_bf16bf16f32 from MindSpore's own
// libdnnl, which runs on AVX512-BF16); X, A and B themselves stay fp32 between the products, and
// the a X term is added in fp32 and the small A A product runs in fp32 (torch's Muon keeps
// everything in bf16). The bf16 products are full GEMMs on the bf16 units (no bf16 SYRK).
//
// Kernel (inputs, then the output, in `params`):
//   MuonNewtonSchulz(x [..., m, n] fp32, coeffs [steps, 3] fp32, flags fp32 [2] = {bf16 0/1, eps})
//     -> out [..., m, n] fp32: each trailing [m, n] matrix orthogonalised alone.

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_math.h"

#define MSLLM_EXPORT extern "C" __attribute__((visibility("default")))

using namespace msllm;

namespace {

// oneDNN's row-major C API: dnnl_status_t dnnl_gemm_bf16bf16f32(char transa, char transb,
// dnnl_dim_t M, N, K, float alpha, const bfloat16_t *A, lda, const bfloat16_t *B, ldb, float beta,
// float *C, ldc); dnnl_dim_t is int64_t, bfloat16_t a uint16_t, dnnl_success 0.
typedef int (*DnnlGemmBf16)(char, char, int64_t, int64_t, int64_t, float, const uint16_t *, int64_t,
                            const uint16_t *, int64_t, float, float *, int64_t);
DnnlGemmBf16 g_dnnl_bf16 = nullptr;

inline uint16_t to_bf16(float f) {   // round to nearest even (inputs are finite)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

void round_bf16(const float *src, uint16_t *dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_bf16(src[i]);
}

// The lower triangle of row-major [k, k] `a` from its upper one.
void mirror_upper(float *a, int64_t k) {
  for (int64_t i = 0; i < k; ++i)
    for (int64_t j = i + 1; j < k; ++j) a[j * k + i] = a[i * k + j];
}

void normalise(const float *x, float *y, int64_t n, float eps) {
  double sq = 0.0;
  for (int64_t i = 0; i < n; ++i) sq += double(x[i]) * double(x[i]);
  const float norm = std::max(float(std::sqrt(sq)), eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] / norm;
}

// Newton-Schulz of one row-major [m, n] matrix `x` into `out` (workspaces: a, b [k*k], y [m*n]).
void ns_f32(const float *x, float *out, int64_t m, int64_t n, const float *coeffs, int64_t steps,
            float eps, float *a, float *b, float *y) {
  const bool tall = m > n;
  const int64_t k = tall ? n : m;   // the Gram side
  const int64_t big = tall ? m : n;
  float *cur = out, *nxt = y;
  normalise(x, cur, m * n, eps);
  for (int64_t s = 0; s < steps; ++s) {
    const float ca = coeffs[3 * s], cb = coeffs[3 * s + 1], cc = coeffs[3 * s + 2];
    // A = X X^T (wide) or X^T X (tall), upper triangle
    scipy_cblas_ssyrk(CblasRowMajor, CblasUpper, tall ? CblasTrans : CblasNoTrans, blasint(k),
                      blasint(big), 1.0f, cur, blasint(n), 0.0f, a, blasint(k));
    mirror_upper(a, k);
    // B = c A A^T + b A + a I (upper), then mirrored
    if (cc != 0.0f) {
      scipy_cblas_ssyrk(CblasRowMajor, CblasUpper, CblasNoTrans, blasint(k), blasint(k), cc, a,
                        blasint(k), 0.0f, b, blasint(k));
    } else {
      std::memset(b, 0, sizeof(float) * k * k);
    }
    for (int64_t i = 0; i < k; ++i) {
      for (int64_t j = i; j < k; ++j) b[i * k + j] += cb * a[i * k + j];
      b[i * k + i] += ca;
    }
    mirror_upper(b, k);
    if (tall)   // X [m, n] <- X B
      scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, blasint(m), blasint(n), blasint(n),
                        1.0f, cur, blasint(n), b, blasint(n), 0.0f, nxt, blasint(n));
    else        // X [m, n] <- B X
      scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, blasint(m), blasint(n), blasint(m),
                        1.0f, b, blasint(m), cur, blasint(n), 0.0f, nxt, blasint(n));
    std::swap(cur, nxt);
  }
  if (cur != out) std::memcpy(out, cur, sizeof(float) * m * n);
}

// The same with bf16 GEMM operands (fp32 accumulation and fp32 X, A, B between the products).
// Workspaces: a, b [k*k] fp32, y [m*n] fp32, xb [m*n], ab [k*k] bf16.
bool ns_bf16(const float *x, float *out, int64_t m, int64_t n, const float *coeffs, int64_t steps,
             float eps, float *a, float *b, float *y, uint16_t *xb, uint16_t *ab) {
  const bool tall = m > n;
  const int64_t k = tall ? n : m;
  float *cur = out, *nxt = y;
  normalise(x, cur, m * n, eps);
  for (int64_t s = 0; s < steps; ++s) {
    const float ca = coeffs[3 * s], cb = coeffs[3 * s + 1], cc = coeffs[3 * s + 2];
    round_bf16(cur, xb, m * n);
    int rc = tall ? g_dnnl_bf16('T', 'N', k, k, m, 1.0f, xb, n, xb, n, 0.0f, a, k)    // X^T X
                  : g_dnnl_bf16('N', 'T', k, k, n, 1.0f, xb, n, xb, n, 0.0f, a, k);   // X X^T
    if (rc != 0) return false;
    // A A in fp32 (SYRK; k^3 flops against 2 k^2 N per bf16 product): A rounded to bf16
    // there measured twice torch's all-bf16 error (Frobenius, 5 steps), this about equal to it.
    if (cc != 0.0f) {
      scipy_cblas_ssyrk(CblasRowMajor, CblasUpper, CblasNoTrans, blasint(k), blasint(k), cc, a,
                        blasint(k), 0.0f, b, blasint(k));
    } else {
      std::memset(b, 0, sizeof(float) * k * k);
    }
    for (int64_t i = 0; i < k; ++i)
      for (int64_t j = i; j < k; ++j) b[i * k + j] += cb * a[i * k + j];
    mirror_upper(b, k);
    // X <- a X + B X: a X is added in fp32 (beta = a on a copy of X), not folded into B as a I:
    // B's diagonal (~a) rounded to bf16 would be off by up to a * 2^-9, more than all else.
    round_bf16(b, ab, k * k);
    std::memcpy(nxt, cur, sizeof(float) * m * n);
    rc = tall ? g_dnnl_bf16('N', 'N', m, n, n, 1.0f, xb, n, ab, n, ca, nxt, n)     // X B
              : g_dnnl_bf16('N', 'N', m, n, m, 1.0f, ab, m, xb, n, ca, nxt, n);    // B X
    if (rc != 0) return false;
    std::swap(cur, nxt);
  }
  if (cur != out) std::memcpy(out, cur, sizeof(float) * m * n);
  return true;
}

}  // namespace

MSLLM_EXPORT void MsLlmMuonSetBf16Gemm(void *fn) { g_dnnl_bf16 = reinterpret_cast<DnnlGemmBf16>(fn); }

MSLLM_EXPORT int MsLlmMuonHasBf16Gemm() { return g_dnnl_bf16 != nullptr; }

MSLLM_EXPORT int MuonNewtonSchulz(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                  void *, void *) {
  if (nparam != 4 || ndims[0] < 2 || ndims[1] != 2 || shapes[1][1] != 3 || !is_f32(dtypes[0]) ||
      !is_f32(dtypes[1]) || !is_f32(dtypes[2]) || numel(ndims[2], shapes[2]) != 2 || !is_f32(dtypes[3]))
    return 1;
  const int64_t m = shapes[0][ndims[0] - 2], n = shapes[0][ndims[0] - 1];
  const int64_t total = numel(ndims[0], shapes[0]);
  if (m <= 0 || n <= 0 || m * n == 0) return 0;
  const int64_t batch = total / (m * n), steps = shapes[1][0];
  const float *x = static_cast<const float *>(params[0]);
  const float *coeffs = static_cast<const float *>(params[1]);
  const float *flags = static_cast<const float *>(params[2]);
  float *out = static_cast<float *>(params[3]);
  const bool bf16 = flags[0] != 0.0f;
  const float eps = flags[1];
  if (bf16 && g_dnnl_bf16 == nullptr) return 2;
  if (m >= (int64_t(1) << 31) || n >= (int64_t(1) << 31)) return 3;
  const int64_t k = std::min(m, n);
  std::vector<float> a(k * k), b(k * k), y(m * n);
  std::vector<uint16_t> xb(bf16 ? m * n : 0), ab(bf16 ? k * k : 0);
  for (int64_t i = 0; i < batch; ++i) {
    const float *xi = x + i * m * n;
    float *oi = out + i * m * n;
    if (bf16) {
      if (!ns_bf16(xi, oi, m, n, coeffs, steps, eps, a.data(), b.data(), y.data(), xb.data(), ab.data()))
        return 4;
    } else {
      ns_f32(xi, oi, m, n, coeffs, steps, eps, a.data(), b.data(), y.data());
    }
  }
  return 0;
}

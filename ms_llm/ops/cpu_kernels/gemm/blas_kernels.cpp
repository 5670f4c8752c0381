// BLAS-backed fp32 CPU kernels for ms-llm (linear, batched matmul), called by MindSpore through
// ops.Custom(func_type="aot"). Built by build.py into its own library, libmsllm_blas_kernels.so,
// linked against the OpenBLAS of the PyPI package scipy-openblas32 (symbols prefixed `scipy_`):
//   g++ -O3 -march=native -fopenmp-simd -shared -fPIC -I<inc> blas_kernels.cpp -L<lib> -lscipy_openblas
//       -Wl,-rpath,<lib>
// so that kernels.cpp (libmsllm_cpu_kernels.so) keeps working when scipy-openblas32 is missing.
//
// Signature of every exported kernel (inputs first, then outputs, in `params`):
//   extern "C" int Fn(int nparam, void **params, int *ndims, int64_t **shapes,
//                     const char **dtypes, void *stream, void *extra)
// Non-zero return makes MindSpore raise. Python scalars arrive as 0-d tensors (int -> "int64").
//
// bf16: every float tensor may be fp32 or bf16 ("bfloat16"), independently. bf16 inputs are
// widened to fp32 (exact) and multiplied with fp32 accumulation, bf16 outputs are rounded to
// nearest even from the fp32 result. The GEMM itself is OpenBLAS sgemm on the widened values, or,
// when Python registered one (MsLlmBlasSetBf16Gemm: oneDNN's matmul primitive or oneMKL's
// cblas_gemm_bf16bf16f32, which run on AVX512-BF16 / AMX units), a native bf16 x bf16 -> fp32 GEMM
// on the bf16 operands directly; with oneDNN also registered as MsLlmBlasSetBf16Matmul, bf16
// outputs are written by the primitive itself (gemm_out). All compute the same numbers up to the
// fp32 summation order. (Editing this file rebuilds the library: its key hashes the sources.)
//
// Threading: the GEMMs run on OpenBLAS's own pthread pool (default: one thread per CPU in the
// affinity mask, or OPENBLAS_NUM_THREADS / GOTO_NUM_THREADS / OMP_NUM_THREADS read when the library
// is loaded; MsLlmBlasSetThreads changes it at run time). The element-wise parts (bias, bias grad)
// are single-threaded and memory-bound.

#include <cblas.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_math.h"

#define MSLLM_EXPORT extern "C" __attribute__((visibility("default")))

using namespace msllm;

namespace {

bool read_int(const void *p, const char *d, int64_t *out) {
  if (std::strcmp(d, "int64") == 0 || std::strcmp(d, "int") == 0) {
    *out = *static_cast<const int64_t *>(p);
  } else if (std::strcmp(d, "int32") == 0) {
    *out = *static_cast<const int32_t *>(p);
  } else if (std::strcmp(d, "bool") == 0) {
    *out = *static_cast<const bool *>(p) ? 1 : 0;
  } else {
    return false;
  }
  return true;
}

bool fits(int64_t v) { return v >= 0 && v < (int64_t(1) << 31); }

bool is_bf16(const char *d) { return std::strcmp(d, "bfloat16") == 0; }
bool is_float(const char *d) { return is_f32(d) || is_bf16(d); }

// cblas_gemm_bf16bf16f32's signature (MKL_INT = int in the LP64 interface, MKL_BF16 = uint16).
typedef void (*GemmBf16Fn)(int, int, int, int, int, int, float, const uint16_t *, int, const uint16_t *,
                           int, float, float *, int);
GemmBf16Fn g_gemm_bf16 = nullptr;

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even; NaN stays a (quiet) NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// An input tensor seen as fp32 (bf16 widened once, on first use) and, if bf16, as raw bf16.
struct In {
  const float *f32 = nullptr;
  const uint16_t *bf = nullptr;
  int64_t n = 0;
  std::vector<float> tmp;
  In(const void *p, const char *d, int64_t count) : n(count) {
    if (is_bf16(d)) bf = static_cast<const uint16_t *>(p);
    else f32 = static_cast<const float *>(p);
  }
  const float *f() {
    if (!f32) {
      tmp.resize(static_cast<size_t>(n));
      float *t = tmp.data();
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) t[i] = bf16_to_f32(bf[i]);
      f32 = t;
    }
    return f32;
  }
};

// An output tensor: computed in fp32 (in place, or in a scratch buffer -- allocated by f() on first
// use -- rounded into bf16 by done()), or, for a bf16 output the registered bf16 matmul writes
// directly (gemm_out), never widened at all.
struct Out {
  float *f32 = nullptr;
  uint16_t *bf = nullptr;
  int64_t n = 0;
  std::vector<float> tmp;
  Out(void *p, const char *d, int64_t count) : n(count) {
    if (is_bf16(d)) bf = static_cast<uint16_t *>(p);
    else f32 = static_cast<float *>(p);
  }
  float *f() {
    if (!f32) {
      tmp.resize(static_cast<size_t>(n));
      f32 = tmp.data();
    }
    return f32;
  }
  void done() {
    if (!bf || tmp.empty()) return;
    const float *t = f32;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) bf[i] = f32_to_bf16(t[i]);
  }
};

// A bf16 x bf16 -> fp32-or-bf16 matmul (fp32 accumulation) with MsLlmDnnlMatmulBf16's signature,
// registered by Python next to g_gemm_bf16 (oneDNN's matmul primitive): lets a bf16 output skip the
// fp32 scratch buffer and the rounding pass. Returns 0 on success.
typedef int (*MatmulBf16Fn)(int, int, int64_t, int64_t, int64_t, const uint16_t *, int64_t, const uint16_t *,
                            int64_t, void *, int64_t, int);
MatmulBf16Fn g_matmul_bf16 = nullptr;

// C[m, n] = op(A) op(B) (+ beta * C), row-major contiguous operands; op(A) is [m, k], op(B) [k, n].
// A is stored [m, k] (ta=false) or [k, m] (ta=true); B is stored [k, n] or [n, k].
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float *a, const float *b, float beta,
          float *c) {
  if (m == 0 || n == 0) return;
  if (k == 0) {  // OpenBLAS rejects lda = 0; the product is empty
    if (beta == 0.f) std::memset(c, 0, sizeof(float) * m * n);
    return;
  }
  scipy_cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                    static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k), 1.0f, a,
                    static_cast<blasint>(ta ? m : k), b, static_cast<blasint>(tb ? k : n), beta, c,
                    static_cast<blasint>(n));
}

// gemm() on In operands at element offsets oa, ob: the native bf16 GEMM when both are bf16 and one
// is registered, else sgemm on the fp32 (widened) values.
void gemm_in(bool ta, bool tb, int64_t m, int64_t n, int64_t k, In &a, int64_t oa, In &b, int64_t ob,
             float beta, float *c) {
  if (g_gemm_bf16 && a.bf && b.bf && m && n && k) {
    g_gemm_bf16(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), 1.0f, a.bf + oa,
                static_cast<int>(ta ? m : k), b.bf + ob, static_cast<int>(tb ? k : n), beta, c,
                static_cast<int>(n));
    return;
  }
  gemm(ta, tb, m, n, k, a.f() + oa, b.f() + ob, beta, c);
}

// C (elements [oc, oc + m n) of Out c) = op(A) op(B), beta 0: straight into a bf16 output through
// the registered bf16 matmul when all three are bf16, else gemm_in into c's fp32 view.
void gemm_out(bool ta, bool tb, int64_t m, int64_t n, int64_t k, In &a, int64_t oa, In &b, int64_t ob, Out &c,
              int64_t oc) {
  if (g_matmul_bf16 && a.bf && b.bf && c.bf && !c.f32 && m && n && k &&
      g_matmul_bf16(ta, tb, m, n, k, a.bf + oa, ta ? m : k, b.bf + ob, tb ? k : n, c.bf + oc, n, 1) == 0)
    return;
  if (c.bf && !c.f32 && g_matmul_bf16) {  // direct path failed here: round this block on its own
    std::vector<float> t(static_cast<size_t>(m * n));
    gemm_in(ta, tb, m, n, k, a, oa, b, ob, 0.f, t.data());
    for (int64_t i = 0; i < m * n; ++i) c.bf[oc + i] = f32_to_bf16(t[i]);
    return;
  }
  gemm_in(ta, tb, m, n, k, a, oa, b, ob, 0.f, c.f() + oc);
}

// --- linear: y[M, N] = x[M, K] w[N, K]^T (+ b[N]), x any shape [..., K]
int linear_fwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, bool bias) {
  const int nin = bias ? 3 : 2;
  if (nparam != nin + 1) return kErrNParam;
  for (int i = 0; i <= nin; ++i)
    if (!is_float(dtypes[i])) return kErrDtype;
  if (ndims[0] < 1 || ndims[1] != 2) return kErrShape;
  const int64_t k = shapes[0][ndims[0] - 1];
  const int64_t n = shapes[1][0];
  if (shapes[1][1] != k) return kErrShape;
  const int64_t m = k ? numel(ndims[0], shapes[0]) / k : numel(ndims[0] - 1, shapes[0]);
  if (bias && numel(ndims[2], shapes[2]) != n) return kErrShape;
  if (numel(ndims[nin], shapes[nin]) != m * n) return kErrShape;
  if (!fits(m) || !fits(n) || !fits(k)) return kErrTooLarge;
  In x(params[0], dtypes[0], m * k), w(params[1], dtypes[1], n * k);
  Out y(params[nin], dtypes[nin], m * n);
  float beta = 0.f;
  if (bias) {  // prefill rows with the bias and accumulate (OpenBLAS scales C by beta first anyway)
    In b(params[2], dtypes[2], n);
    const float *bv = b.f();
    float *yf = y.f();
    for (int64_t i = 0; i < m; ++i) std::memcpy(yf + i * n, bv, sizeof(float) * n);
    beta = 1.f;
  }
  if (k == 0 && !bias) {
    std::memset(y.f(), 0, sizeof(float) * m * n);
  } else if (bias) {
    gemm_in(false, true, m, n, k, x, 0, w, 0, beta, y.f());
  } else {
    gemm_out(false, true, m, n, k, x, 0, w, 0, y, 0);
  }
  y.done();
  return 0;
}

// --- linear backward: (x, w, dy) -> dx = dy w, dw = dy^T x (, db = sum_rows dy)
int linear_bwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, bool bias) {
  const int nout = bias ? 3 : 2;
  if (nparam != 3 + nout) return kErrNParam;
  for (int i = 0; i < 3 + nout; ++i)
    if (!is_float(dtypes[i])) return kErrDtype;
  if (ndims[0] < 1 || ndims[1] != 2) return kErrShape;
  const int64_t k = shapes[0][ndims[0] - 1];
  const int64_t n = shapes[1][0];
  if (shapes[1][1] != k) return kErrShape;
  const int64_t m = k ? numel(ndims[0], shapes[0]) / k : numel(ndims[0] - 1, shapes[0]);
  if (numel(ndims[2], shapes[2]) != m * n) return kErrShape;
  if (numel(ndims[3], shapes[3]) != m * k || numel(ndims[4], shapes[4]) != n * k) return kErrShape;
  if (bias && numel(ndims[5], shapes[5]) != n) return kErrShape;
  if (!fits(m) || !fits(n) || !fits(k)) return kErrTooLarge;
  In x(params[0], dtypes[0], m * k), w(params[1], dtypes[1], n * k), dy(params[2], dtypes[2], m * n);
  Out dx(params[3], dtypes[3], m * k), dw(params[4], dtypes[4], n * k);
  if (n == 0 || m == 0) {  // empty products: gradients are zero
    std::memset(dx.f(), 0, sizeof(float) * m * k);
    std::memset(dw.f(), 0, sizeof(float) * n * k);
  } else {
    gemm_out(false, false, m, k, n, dy, 0, w, 0, dx, 0);  // [M, N] x [N, K]
    gemm_out(true, false, n, k, m, dy, 0, x, 0, dw, 0);   // dy stored [M, N] -> dy^T [N, M]; x [M, K]
  }
  dx.done();
  dw.done();
  if (bias) {
    Out db(params[5], dtypes[5], n);
    const float *g = dy.f();
    std::vector<double> acc(static_cast<size_t>(n), 0.0);  // double: sums of up to ~1e5 rows
    double *a = acc.data();
    for (int64_t i = 0; i < m; ++i) {
      const float *row = g + i * n;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) a[j] += row[j];
    }
    float *dbf = db.f();
    for (int64_t j = 0; j < n; ++j) dbf[j] = static_cast<float>(a[j]);
    db.done();
  }
  return 0;
}

// --- batched matmul over matching leading dims: c[..., M, N] = op(a) op(b)
// a: [..., M, K] (ta=0) or [..., K, M] (ta=1); b: [..., K, N] (tb=0) or [..., N, K] (tb=1).
struct BmmDims {
  int64_t batch, m, n, k;
};

bool bmm_dims(int *ndims, int64_t **shapes, bool ta, bool tb, BmmDims *d) {
  if (ndims[0] < 2 || ndims[1] < 2) return false;
  const int64_t *sa = shapes[0], *sb = shapes[1];
  const int na = ndims[0], nb = ndims[1];
  const int64_t a0 = sa[na - 2], a1 = sa[na - 1], b0 = sb[nb - 2], b1 = sb[nb - 1];
  d->m = ta ? a1 : a0;
  d->k = ta ? a0 : a1;
  d->n = tb ? b0 : b1;
  if ((tb ? b1 : b0) != d->k) return false;
  d->batch = numel(na - 2, sa);
  return numel(nb - 2, sb) == d->batch;
}

int bmm_flags(void **params, const char **dtypes, int ia, bool *ta, bool *tb) {
  int64_t v0, v1;
  if (!read_int(params[ia], dtypes[ia], &v0) || !read_int(params[ia + 1], dtypes[ia + 1], &v1)) return kErrDtype;
  *ta = v0 != 0;
  *tb = v1 != 0;
  return 0;
}

}  // namespace

MSLLM_EXPORT int MsLlmBlasKernelsAbiVersion() { return 1; }

// Register (or, with nullptr, remove) a native bf16 GEMM with cblas_gemm_bf16bf16f32's signature.
MSLLM_EXPORT void MsLlmBlasSetBf16Gemm(void *fn) { g_gemm_bf16 = reinterpret_cast<GemmBf16Fn>(fn); }

MSLLM_EXPORT int MsLlmBlasHasBf16Gemm() { return g_gemm_bf16 != nullptr; }

// Register (or remove) a bf16 matmul that may write bf16 outputs directly (MsLlmDnnlMatmulBf16).
MSLLM_EXPORT void MsLlmBlasSetBf16Matmul(void *fn) { g_matmul_bf16 = reinterpret_cast<MatmulBf16Fn>(fn); }

MSLLM_EXPORT int MsLlmBlasGetThreads() { return scipy_openblas_get_num_threads(); }

MSLLM_EXPORT void MsLlmBlasSetThreads(int n) { scipy_openblas_set_num_threads(n); }

// 0 sequential, 1 pthreads, 2 OpenMP
MSLLM_EXPORT int MsLlmBlasParallel() { return scipy_openblas_get_parallel(); }

MSLLM_EXPORT const char *MsLlmBlasConfig() { return scipy_openblas_get_config(); }

MSLLM_EXPORT int LinearFwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                           void *) {
  return linear_fwd(nparam, params, ndims, shapes, dtypes, false);
}

MSLLM_EXPORT int LinearBiasFwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                               void *, void *) {
  return linear_fwd(nparam, params, ndims, shapes, dtypes, true);
}

MSLLM_EXPORT int LinearBwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                           void *) {
  return linear_bwd(nparam, params, ndims, shapes, dtypes, false);
}

MSLLM_EXPORT int LinearBiasBwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                               void *, void *) {
  return linear_bwd(nparam, params, ndims, shapes, dtypes, true);
}

// (a, b, ta, tb) -> c
MSLLM_EXPORT int BmmFwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                        void *) {
  if (nparam != 5) return kErrNParam;
  if (!is_float(dtypes[0]) || !is_float(dtypes[1]) || !is_float(dtypes[4])) return kErrDtype;
  bool ta, tb;
  if (int e = bmm_flags(params, dtypes, 2, &ta, &tb)) return e;
  BmmDims d;
  if (!bmm_dims(ndims, shapes, ta, tb, &d)) return kErrShape;
  if (numel(ndims[4], shapes[4]) != d.batch * d.m * d.n) return kErrShape;
  if (!fits(d.m) || !fits(d.n) || !fits(d.k)) return kErrTooLarge;
  In a(params[0], dtypes[0], d.batch * d.m * d.k), b(params[1], dtypes[1], d.batch * d.k * d.n);
  Out c(params[4], dtypes[4], d.batch * d.m * d.n);
  for (int64_t i = 0; i < d.batch; ++i)
    gemm_out(ta, tb, d.m, d.n, d.k, a, i * d.m * d.k, b, i * d.k * d.n, c, i * d.m * d.n);
  c.done();
  return 0;
}

// (a, b, dc, ta, tb) -> (da, db)
MSLLM_EXPORT int BmmBwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                        void *) {
  if (nparam != 7) return kErrNParam;
  for (int i : {0, 1, 2, 5, 6})
    if (!is_float(dtypes[i])) return kErrDtype;
  bool ta, tb;
  if (int e = bmm_flags(params, dtypes, 3, &ta, &tb)) return e;
  BmmDims d;
  if (!bmm_dims(ndims, shapes, ta, tb, &d)) return kErrShape;
  const int64_t sa = d.m * d.k, sb = d.k * d.n, sc = d.m * d.n;
  if (numel(ndims[2], shapes[2]) != d.batch * sc || numel(ndims[5], shapes[5]) != d.batch * sa ||
      numel(ndims[6], shapes[6]) != d.batch * sb)
    return kErrShape;
  if (!fits(d.m) || !fits(d.n) || !fits(d.k)) return kErrTooLarge;
  In a(params[0], dtypes[0], d.batch * sa), b(params[1], dtypes[1], d.batch * sb),
      dc(params[2], dtypes[2], d.batch * sc);
  Out da(params[5], dtypes[5], d.batch * sa), db(params[6], dtypes[6], d.batch * sb);
  const int64_t m = d.m, n = d.n, k = d.k;
  for (int64_t i = 0; i < d.batch; ++i) {
    const int64_t oa = i * sa, ob = i * sb, og = i * sc;
    if (!ta && !tb) {         // a [M,K], b [K,N]
      gemm_out(false, true, m, k, n, dc, og, b, ob, da, oa);   // dA = dC B^T      [M,K]
      gemm_out(true, false, k, n, m, a, oa, dc, og, db, ob);   // dB = A^T dC      [K,N]
    } else if (!ta && tb) {   // a [M,K], b [N,K]
      gemm_out(false, false, m, k, n, dc, og, b, ob, da, oa);  // dA = dC B        [M,K]
      gemm_out(true, false, n, k, m, dc, og, a, oa, db, ob);   // dB = dC^T A      [N,K]
    } else if (ta && !tb) {   // a [K,M], b [K,N]
      gemm_out(false, true, k, m, n, b, ob, dc, og, da, oa);   // dA = B dC^T      [K,M]
      gemm_out(false, false, k, n, m, a, oa, dc, og, db, ob);  // dB = A dC        [K,N]
    } else {                  // a [K,M], b [N,K]
      gemm_out(true, true, k, m, n, b, ob, dc, og, da, oa);    // dA = B^T dC^T    [K,M]
      gemm_out(true, true, n, k, m, dc, og, a, oa, db, ob);    // dB = dC^T A^T    [N,K]
    }
  }
  da.done();
  db.done();
  return 0;
}

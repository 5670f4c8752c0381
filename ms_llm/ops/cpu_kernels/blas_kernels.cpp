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
// Threading: the GEMMs run on OpenBLAS's own pthread pool (default: one thread per CPU in the
// affinity mask, or OPENBLAS_NUM_THREADS / GOTO_NUM_THREADS / OMP_NUM_THREADS read when the library
// is loaded; MsLlmBlasSetThreads changes it at run time). The element-wise parts (bias, bias grad)
// are single-threaded and memory-bound.

#include <cblas.h>

#include <cstdint>
#include <cstring>
#include <vector>

#define MSLLM_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

constexpr int kErrDtype = 1;
constexpr int kErrShape = 2;
constexpr int kErrNParam = 4;
constexpr int kErrTooLarge = 5;  // a GEMM dimension does not fit OpenBLAS's 32-bit blasint

int64_t numel(int nd, const int64_t *s) {
  int64_t n = 1;
  for (int i = 0; i < nd; ++i) n *= s[i];
  return n;
}

bool is_f32(const char *d) { return std::strcmp(d, "float32") == 0 || std::strcmp(d, "float") == 0; }

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

// --- linear: y[M, N] = x[M, K] w[N, K]^T (+ b[N]), x any shape [..., K]
int linear_fwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, bool bias) {
  const int nin = bias ? 3 : 2;
  if (nparam != nin + 1) return kErrNParam;
  for (int i = 0; i <= nin; ++i)
    if (!is_f32(dtypes[i])) return kErrDtype;
  if (ndims[0] < 1 || ndims[1] != 2) return kErrShape;
  const int64_t k = shapes[0][ndims[0] - 1];
  const int64_t n = shapes[1][0];
  if (shapes[1][1] != k) return kErrShape;
  const int64_t m = k ? numel(ndims[0], shapes[0]) / k : numel(ndims[0] - 1, shapes[0]);
  if (bias && numel(ndims[2], shapes[2]) != n) return kErrShape;
  if (numel(ndims[nin], shapes[nin]) != m * n) return kErrShape;
  if (!fits(m) || !fits(n) || !fits(k)) return kErrTooLarge;
  const float *x = static_cast<const float *>(params[0]);
  const float *w = static_cast<const float *>(params[1]);
  float *y = static_cast<float *>(params[nin]);
  float beta = 0.f;
  if (bias) {  // prefill rows with the bias and accumulate (OpenBLAS scales C by beta first anyway)
    const float *b = static_cast<const float *>(params[2]);
    for (int64_t i = 0; i < m; ++i) std::memcpy(y + i * n, b, sizeof(float) * n);
    beta = 1.f;
  }
  if (k == 0 && !bias) {
    std::memset(y, 0, sizeof(float) * m * n);
    return 0;
  }
  gemm(false, true, m, n, k, x, w, beta, y);
  return 0;
}

// --- linear backward: (x, w, dy) -> dx = dy w, dw = dy^T x (, db = sum_rows dy)
int linear_bwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, bool bias) {
  const int nout = bias ? 3 : 2;
  if (nparam != 3 + nout) return kErrNParam;
  for (int i = 0; i < 3 + nout; ++i)
    if (!is_f32(dtypes[i])) return kErrDtype;
  if (ndims[0] < 1 || ndims[1] != 2) return kErrShape;
  const int64_t k = shapes[0][ndims[0] - 1];
  const int64_t n = shapes[1][0];
  if (shapes[1][1] != k) return kErrShape;
  const int64_t m = k ? numel(ndims[0], shapes[0]) / k : numel(ndims[0] - 1, shapes[0]);
  if (numel(ndims[2], shapes[2]) != m * n) return kErrShape;
  if (numel(ndims[3], shapes[3]) != m * k || numel(ndims[4], shapes[4]) != n * k) return kErrShape;
  if (bias && numel(ndims[5], shapes[5]) != n) return kErrShape;
  if (!fits(m) || !fits(n) || !fits(k)) return kErrTooLarge;
  const float *x = static_cast<const float *>(params[0]);
  const float *w = static_cast<const float *>(params[1]);
  const float *dy = static_cast<const float *>(params[2]);
  float *dx = static_cast<float *>(params[3]);
  float *dw = static_cast<float *>(params[4]);
  if (n == 0 || m == 0) {  // empty products: gradients are zero
    std::memset(dx, 0, sizeof(float) * m * k);
    std::memset(dw, 0, sizeof(float) * n * k);
  } else {
    gemm(false, false, m, k, n, dy, w, 0.f, dx);  // [M, N] x [N, K]
    gemm(true, false, n, k, m, dy, x, 0.f, dw);   // dy stored [M, N] -> dy^T [N, M]; x [M, K]
  }
  if (bias) {
    float *db = static_cast<float *>(params[5]);
    std::vector<double> acc(static_cast<size_t>(n), 0.0);  // double: sums of up to ~1e5 rows
    double *a = acc.data();
    for (int64_t i = 0; i < m; ++i) {
      const float *row = dy + i * n;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) a[j] += row[j];
    }
    for (int64_t j = 0; j < n; ++j) db[j] = static_cast<float>(a[j]);
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
  if (!is_f32(dtypes[0]) || !is_f32(dtypes[1]) || !is_f32(dtypes[4])) return kErrDtype;
  bool ta, tb;
  if (int e = bmm_flags(params, dtypes, 2, &ta, &tb)) return e;
  BmmDims d;
  if (!bmm_dims(ndims, shapes, ta, tb, &d)) return kErrShape;
  if (numel(ndims[4], shapes[4]) != d.batch * d.m * d.n) return kErrShape;
  if (!fits(d.m) || !fits(d.n) || !fits(d.k)) return kErrTooLarge;
  const float *a = static_cast<const float *>(params[0]);
  const float *b = static_cast<const float *>(params[1]);
  float *c = static_cast<float *>(params[4]);
  for (int64_t i = 0; i < d.batch; ++i)
    gemm(ta, tb, d.m, d.n, d.k, a + i * d.m * d.k, b + i * d.k * d.n, 0.f, c + i * d.m * d.n);
  return 0;
}

// (a, b, dc, ta, tb) -> (da, db)
MSLLM_EXPORT int BmmBwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                        void *) {
  if (nparam != 7) return kErrNParam;
  for (int i : {0, 1, 2, 5, 6})
    if (!is_f32(dtypes[i])) return kErrDtype;
  bool ta, tb;
  if (int e = bmm_flags(params, dtypes, 3, &ta, &tb)) return e;
  BmmDims d;
  if (!bmm_dims(ndims, shapes, ta, tb, &d)) return kErrShape;
  const int64_t sa = d.m * d.k, sb = d.k * d.n, sc = d.m * d.n;
  if (numel(ndims[2], shapes[2]) != d.batch * sc || numel(ndims[5], shapes[5]) != d.batch * sa ||
      numel(ndims[6], shapes[6]) != d.batch * sb)
    return kErrShape;
  if (!fits(d.m) || !fits(d.n) || !fits(d.k)) return kErrTooLarge;
  const float *a = static_cast<const float *>(params[0]);
  const float *b = static_cast<const float *>(params[1]);
  const float *dc = static_cast<const float *>(params[2]);
  float *da = static_cast<float *>(params[5]);
  float *db = static_cast<float *>(params[6]);
  const int64_t m = d.m, n = d.n, k = d.k;
  for (int64_t i = 0; i < d.batch; ++i) {
    const float *ai = a + i * sa, *bi = b + i * sb, *gi = dc + i * sc;
    float *dai = da + i * sa, *dbi = db + i * sb;
    if (!ta && !tb) {         // a [M,K], b [K,N]
      gemm(false, true, m, k, n, gi, bi, 0.f, dai);   // dA = dC B^T      [M,K]
      gemm(true, false, k, n, m, ai, gi, 0.f, dbi);   // dB = A^T dC      [K,N]
    } else if (!ta && tb) {   // a [M,K], b [N,K]
      gemm(false, false, m, k, n, gi, bi, 0.f, dai);  // dA = dC B        [M,K]
      gemm(true, false, n, k, m, gi, ai, 0.f, dbi);   // dB = dC^T A      [N,K]
    } else if (ta && !tb) {   // a [K,M], b [K,N]
      gemm(false, true, k, m, n, bi, gi, 0.f, dai);   // dA = B dC^T      [K,M]
      gemm(false, false, k, n, m, ai, gi, 0.f, dbi);  // dB = A dC        [K,N]
    } else {                  // a [K,M], b [N,K]
      gemm(true, true, k, m, n, bi, gi, 0.f, dai);    // dA = B^T dC^T    [K,M]
      gemm(true, true, n, k, m, gi, ai, 0.f, dbi);    // dB = dC^T A^T    [N,K]
    }
  }
  return 0;
}

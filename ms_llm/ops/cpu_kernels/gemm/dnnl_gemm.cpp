// bf16 x bf16 -> fp32 (or bf16) GEMMs through oneDNN's matmul primitive, for ms-llm's BLAS kernels.
//
// Built by dnnl_build.py into libmsllm_dnnl_gemm.so and linked against the oneDNN 3 that MindSpore's
// wheel ships (<mindspore>/lib/libdnnl.so.3, -Wl,-rpath to it), so no extra package is needed. On
// CPUs with AVX512-BF16 / AMX-BF16 the matmul primitive runs oneDNN's brgemm kernels on those units;
// the plain dnnl_gemm_bf16bf16f32 entry point measured 0.55-0.6x of the primitive's rate here.
//
// Why the C API is declared below instead of included: the wheel ships the library without its
// headers. The declarations are oneDNN 3.x's stable C API (dnnl.h / dnnl_common.h / dnnl_types.h);
// MsLlmDnnlInit() checks the library's major version at run time and refuses anything but 3.
//
// MindSpore's oneDNN is built with the THREADPOOL CPU runtime (dnnl_version()->cpu_runtime == 8): a
// stream without a threadpool runs single-threaded. OmpPool below is that threadpool, on OpenMP,
// with the vtable layout of dnnl::threadpool_interop::threadpool_iface (get_num_threads,
// get_in_parallel, parallel_for, get_flags, wait, destructor).
//
// Primitives are cached per (transposes, shape, leading dimensions, output dtype); memory objects
// are re-pointed at each call's buffers (dnnl_memory_set_data_handle). One mutex serialises calls:
// a primitive's cached memory objects are not re-entrant.

#include <omp.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <tuple>

#define MSLLM_EXPORT extern "C" __attribute__((visibility("default")))

extern "C" {
typedef int64_t dnnl_dim_t;
typedef dnnl_dim_t dnnl_dims_t[12];
typedef int dnnl_status_t;  // dnnl_success == 0
typedef struct dnnl_engine *dnnl_engine_t;
typedef struct dnnl_stream *dnnl_stream_t;
typedef struct dnnl_memory_desc *dnnl_memory_desc_t;
typedef const struct dnnl_memory_desc *const_dnnl_memory_desc_t;
typedef struct dnnl_memory *dnnl_memory_t;
typedef struct dnnl_primitive_desc *dnnl_primitive_desc_t;
typedef struct dnnl_primitive *dnnl_primitive_t;
typedef struct dnnl_primitive_attr *dnnl_primitive_attr_t;
typedef struct {
  int arg;
  dnnl_memory_t memory;
} dnnl_exec_arg_t;
typedef struct {
  int major, minor, patch;
  const char *hash;
  unsigned cpu_runtime, gpu_runtime;
} dnnl_version_t;

const dnnl_version_t *dnnl_version(void);
dnnl_status_t dnnl_engine_create(dnnl_engine_t *engine, int kind, size_t index);
dnnl_status_t dnnl_threadpool_interop_stream_create(dnnl_stream_t *stream, dnnl_engine_t engine, void *tp);
dnnl_status_t dnnl_threadpool_interop_set_max_concurrency(int max_concurrency);
dnnl_status_t dnnl_memory_desc_create_with_strides(dnnl_memory_desc_t *md, int ndims, const dnnl_dims_t dims,
                                                   int data_type, const dnnl_dims_t strides);
dnnl_status_t dnnl_memory_desc_destroy(dnnl_memory_desc_t md);
dnnl_status_t dnnl_matmul_primitive_desc_create(dnnl_primitive_desc_t *pd, dnnl_engine_t engine,
                                                const_dnnl_memory_desc_t src, const_dnnl_memory_desc_t wei,
                                                const_dnnl_memory_desc_t bias, const_dnnl_memory_desc_t dst,
                                                dnnl_primitive_attr_t attr);
dnnl_status_t dnnl_primitive_desc_destroy(dnnl_primitive_desc_t pd);
dnnl_status_t dnnl_primitive_create(dnnl_primitive_t *prim, dnnl_primitive_desc_t pd);
dnnl_status_t dnnl_primitive_execute(dnnl_primitive_t prim, dnnl_stream_t stream, int nargs,
                                     const dnnl_exec_arg_t *args);
dnnl_status_t dnnl_memory_create(dnnl_memory_t *mem, const_dnnl_memory_desc_t md, dnnl_engine_t engine,
                                 void *handle);
dnnl_status_t dnnl_memory_set_data_handle(dnnl_memory_t mem, void *handle);
dnnl_status_t dnnl_stream_wait(dnnl_stream_t stream);
dnnl_status_t dnnl_threadpool_interop_gemm_bf16bf16f32(char transa, char transb, dnnl_dim_t m, dnnl_dim_t n,
                                                       dnnl_dim_t k, float alpha, const uint16_t *a,
                                                       dnnl_dim_t lda, const uint16_t *b, dnnl_dim_t ldb,
                                                       float beta, float *c, dnnl_dim_t ldc, void *tp);
}

namespace {

constexpr int kEngineCpu = 1;   // dnnl_cpu
constexpr int kBf16 = 2;        // dnnl_bf16
constexpr int kF32 = 3;         // dnnl_f32
constexpr int kArgSrc = 1;      // DNNL_ARG_SRC
constexpr int kArgDst = 17;     // DNNL_ARG_DST
constexpr int kArgWeights = 33; // DNNL_ARG_WEIGHTS
constexpr int kCblasTrans = 112;

// Same virtual layout as dnnl::threadpool_interop::threadpool_iface (synchronous pool).
class OmpPool {
 public:
  explicit OmpPool(int n) : threads_(n < 1 ? 1 : n) {}
  virtual int get_num_threads() const { return threads_; }
  virtual bool get_in_parallel() const { return omp_in_parallel() != 0; }
  virtual void parallel_for(int n, const std::function<void(int, int)> &fn) {
    if (n <= 1 || threads_ == 1) {
      for (int i = 0; i < n; ++i) fn(i, n);
      return;
    }
#pragma omp parallel for num_threads(threads_) schedule(static)
    for (int i = 0; i < n; ++i) fn(i, n);
  }
  virtual uint64_t get_flags() const { return 0; }
  virtual void wait() {}
  virtual ~OmpPool() = default;
  int threads_;
};

struct Matmul {
  dnnl_primitive_t prim = nullptr;
  dnnl_memory_t src = nullptr, wei = nullptr, dst = nullptr;
};

using Key = std::tuple<int, int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int>;

std::mutex g_mu;
dnnl_engine_t g_engine = nullptr;
dnnl_stream_t g_stream = nullptr;
OmpPool *g_pool = nullptr;
std::map<Key, Matmul> g_cache;
int g_error = 0;  // first failing dnnl status, for diagnostics

// 2-D memory descriptor of a [rows, cols] operand stored row-major with leading dimension ld, or
// (trans) stored as its transpose [cols, rows].
dnnl_memory_desc_t md2(int64_t rows, int64_t cols, int64_t ld, bool trans, int dt) {
  dnnl_dims_t dims = {rows, cols};
  dnnl_dims_t strides = {trans ? 1 : ld, trans ? ld : 1};
  dnnl_memory_desc_t md = nullptr;
  if (dnnl_memory_desc_create_with_strides(&md, 2, dims, dt, strides) != 0) return nullptr;
  return md;
}

const Matmul *matmul(const Key &key) {
  auto it = g_cache.find(key);
  if (it != g_cache.end()) return &it->second;
  const auto [ta, tb, m, n, k, lda, ldb, ldc, dst_dt] = key;
  dnnl_memory_desc_t a = md2(m, k, lda, ta, kBf16), b = md2(k, n, ldb, tb, kBf16);
  dnnl_memory_desc_t c = md2(m, n, ldc, false, dst_dt);
  Matmul mm;
  dnnl_primitive_desc_t pd = nullptr;
  dnnl_status_t st = (a && b && c) ? dnnl_matmul_primitive_desc_create(&pd, g_engine, a, b, nullptr, c, nullptr)
                                   : -1;
  if (st == 0) st = dnnl_primitive_create(&mm.prim, pd);
  if (st == 0) st = dnnl_memory_create(&mm.src, a, g_engine, nullptr);
  if (st == 0) st = dnnl_memory_create(&mm.wei, b, g_engine, nullptr);
  if (st == 0) st = dnnl_memory_create(&mm.dst, c, g_engine, nullptr);
  if (pd) dnnl_primitive_desc_destroy(pd);
  for (dnnl_memory_desc_t md : {a, b, c})
    if (md) dnnl_memory_desc_destroy(md);
  if (st != 0) {
    if (!g_error) g_error = st ? st : -1;
    return nullptr;
  }
  return &g_cache.emplace(key, mm).first->second;
}

bool run(const Matmul *mm, const void *a, const void *b, void *c) {
  dnnl_memory_set_data_handle(mm->src, const_cast<void *>(a));
  dnnl_memory_set_data_handle(mm->wei, const_cast<void *>(b));
  dnnl_memory_set_data_handle(mm->dst, c);
  const dnnl_exec_arg_t args[3] = {{kArgSrc, mm->src}, {kArgWeights, mm->wei}, {kArgDst, mm->dst}};
  dnnl_status_t st = dnnl_primitive_execute(mm->prim, g_stream, 3, args);
  if (st == 0) st = dnnl_stream_wait(g_stream);
  if (st != 0 && !g_error) g_error = st;
  return st == 0;
}

}  // namespace

MSLLM_EXPORT int MsLlmDnnlAbiVersion() { return 1; }

// Create the engine, the threadpool stream (threads > 0) and set oneDNN's assumed concurrency.
// Returns 0, or: 1 oneDNN is not major version 3, 2 engine/stream creation failed.
MSLLM_EXPORT int MsLlmDnnlInit(int threads) {
  std::lock_guard<std::mutex> lock(g_mu);
  const dnnl_version_t *v = dnnl_version();
  if (!v || v->major != 3) return 1;
  if (!g_engine && dnnl_engine_create(&g_engine, kEngineCpu, 0) != 0) return 2;
  if (g_pool && g_pool->threads_ == threads && g_stream) return 0;
  g_pool = new OmpPool(threads);  // leaked on purpose: a stream may still refer to an old pool
  dnnl_threadpool_interop_set_max_concurrency(g_pool->threads_);
  g_stream = nullptr;
  if (dnnl_threadpool_interop_stream_create(&g_stream, g_engine, g_pool) != 0) return 2;
  g_cache.clear();  // primitives were created for the old concurrency
  return 0;
}

MSLLM_EXPORT int MsLlmDnnlLastError() { return g_error; }

MSLLM_EXPORT int64_t MsLlmDnnlCachedPrimitives() {
  std::lock_guard<std::mutex> lock(g_mu);
  return static_cast<int64_t>(g_cache.size());
}

// C[m, n] (fp32 or bf16, row-major, leading dimension ldc) = op(A) op(B), A and B bf16 row-major
// (op = transpose when ta / tb). fp32 accumulation. Returns 0 on success.
MSLLM_EXPORT int MsLlmDnnlMatmulBf16(int ta, int tb, int64_t m, int64_t n, int64_t k, const uint16_t *a,
                                     int64_t lda, const uint16_t *b, int64_t ldb, void *c, int64_t ldc,
                                     int c_is_bf16) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_stream) return 3;
  const Matmul *mm = matmul(Key{ta != 0, tb != 0, m, n, k, lda, ldb, ldc, c_is_bf16 ? kBf16 : kF32});
  if (!mm) return 4;
  return run(mm, a, b, c) ? 0 : 5;
}

// cblas_gemm_bf16bf16f32's signature (row-major only), for MsLlmBlasSetBf16Gemm: the matmul
// primitive when beta == 0 and alpha == 1, else oneDNN's gemm_bf16bf16f32 on the same threadpool.
MSLLM_EXPORT void MsLlmDnnlCblasGemmBf16(int layout, int transa, int transb, int m, int n, int k, float alpha,
                                         const uint16_t *a, int lda, const uint16_t *b, int ldb, float beta,
                                         float *c, int ldc) {
  (void)layout;  // the BLAS kernels always pass CblasRowMajor
  const bool ta = transa == kCblasTrans, tb = transb == kCblasTrans;
  if (beta == 0.f && alpha == 1.f && MsLlmDnnlMatmulBf16(ta, tb, m, n, k, a, lda, b, ldb, c, ldc, 0) == 0) return;
  std::lock_guard<std::mutex> lock(g_mu);
  dnnl_status_t st = dnnl_threadpool_interop_gemm_bf16bf16f32(ta ? 'T' : 'N', tb ? 'T' : 'N', m, n, k, alpha, a,
                                                              lda, b, ldb, beta, c, ldc, g_pool);
  if (st != 0 && !g_error) g_error = st;
}

// What the BLAS attention kernels share (blas_attention.cpp, blas_pair_attention.cpp): a
// row-major sgemm with explicit leading dimensions, and the split of independent (batch x KV
// group) slices over threads.
#pragma once

#include <cblas.h>

#include <cstdint>
#include <thread>
#include <vector>

namespace msllm {

// C[m, n] (ldc) = op(A) op(B) + beta C, row-major with explicit leading dimensions.
inline void gemm_ld(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float *a, int64_t lda,
                    const float *b, int64_t ldb, float beta, float *c, int64_t ldc) {
  if (m == 0 || n == 0 || k == 0) return;
  scipy_cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                    static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k), 1.0f, a,
                    static_cast<blasint>(lda), b, static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
}

// Runs body(first, last) over the slices [0, n): on T threads with single-threaded GEMMs when
// OpenBLAS has T > 1 threads and there are at least 2 slices, else on this thread. Dozens of
// small GEMMs per slice, each a fork/join of OpenBLAS's spinning pool, cost far more than one
// join per kernel call, most of all on a loaded machine.
template <typename Body>
void for_slices(int64_t n, Body body) {
  const int t = scipy_openblas_get_num_threads();
  const int64_t workers = t < n ? t : n;
  if (workers < 2) {
    body(0, n);
    return;
  }
  scipy_openblas_set_num_threads(1);
  std::vector<std::thread> pool;
  for (int64_t w = 1; w < workers; ++w) pool.emplace_back(body, n * w / workers, n * (w + 1) / workers);
  body(0, n / workers);
  for (auto &th : pool) th.join();
  scipy_openblas_set_num_threads(t);
}

}  // namespace msllm

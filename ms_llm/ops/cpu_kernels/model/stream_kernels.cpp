// The bf16 residual stream's own element-wise work on CPU: the residual add and the token
// embedding (forward gather, backward row sums).
//
// Why: MindSpore 2.10's CPU Add / AddExt run bf16 at ~13-20 ns per element (a 2048 x 512 residual
// add takes ~21 ms against 0.3 ms in fp32), and its Gather has no bf16 kernel, so a bf16 table was
// widened whole (a cast of the [V, h] table every step), gathered in fp32 and its gradient built
// dense in fp32, then added and rounded back in bf16 -- about 0.35 s per step at vocab 32000.
// Both kernels also take fp32 (the same code with float storage). Arithmetic is fp32; bf16 is
// rounded once on store (nearest even), the numbers of MindSpore's bf16 ops.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_math.h"

#define MSLLM_EXPORT extern "C" __attribute__((visibility("default")))

using namespace msllm;

namespace {

template <class T>
int add_t(void **params, int *ndims, int64_t **shapes) {
  const int64_t n = numel(ndims[0], shapes[0]);
  if (numel(ndims[1], shapes[1]) != n || numel(ndims[2], shapes[2]) != n) return kErrShape;
  const T *a = static_cast<const T *>(params[0]);
  const T *b = static_cast<const T *>(params[1]);
  T *y = static_cast<T *>(params[2]);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = from_f32<T>(to_f32(a[i]) + to_f32(b[i]));
  return 0;
}

// ids as int64 whatever their dtype (int32 or int64); false for another dtype.
bool read_ids(const void *p, const char *dtype, int64_t n, std::vector<int64_t> *out) {
  out->resize(static_cast<size_t>(n));
  if (is_i32(dtype)) {
    const int32_t *v = static_cast<const int32_t *>(p);
    for (int64_t i = 0; i < n; ++i) (*out)[i] = v[i];
  } else if (is_i64(dtype)) {
    std::memcpy(out->data(), p, static_cast<size_t>(n) * sizeof(int64_t));
  } else {
    return false;
  }
  return true;
}

template <class T>
int embedding_fwd_t(void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  if (ndims[0] != 2) return kErrShape;
  const int64_t v = shapes[0][0], h = shapes[0][1];
  const int64_t n = numel(ndims[1], shapes[1]);
  if (numel(ndims[2], shapes[2]) != n * h) return kErrShape;
  std::vector<int64_t> ids;
  if (!read_ids(params[1], dtypes[1], n, &ids)) return kErrDtype;
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= v) return kErrLabel;
  const T *w = static_cast<const T *>(params[0]);
  T *y = static_cast<T *>(params[2]);
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(y + i * h, w + ids[i] * h, static_cast<size_t>(h) * sizeof(T));
  return 0;
}

// dw[r] = sum of dy's rows whose id is r, summed in fp32 in token order, stored once; 0 elsewhere.
template <class T>
int embedding_bwd_t(void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  if (ndims[0] != 2) return kErrShape;
  const int64_t v = shapes[0][0], h = shapes[0][1];
  const int64_t n = numel(ndims[1], shapes[1]);
  if (numel(ndims[2], shapes[2]) != n * h || numel(ndims[3], shapes[3]) != v * h) return kErrShape;
  std::vector<int64_t> ids;
  if (!read_ids(params[1], dtypes[1], n, &ids)) return kErrDtype;
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= v) return kErrLabel;
  // counting sort of the tokens by id: start[r] .. start[r + 1] index order[]
  std::vector<int64_t> start(static_cast<size_t>(v + 1), 0), order(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) ++start[ids[i] + 1];
  for (int64_t r = 0; r < v; ++r) start[r + 1] += start[r];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < n; ++i) order[fill[ids[i]]++] = i;
  const T *dy = static_cast<const T *>(params[2]);
  T *dw = static_cast<T *>(params[3]);
  std::memset(dw, 0, static_cast<size_t>(v * h) * sizeof(T));   // +0.0 in fp32 and bf16
  std::vector<float> acc(static_cast<size_t>(h));
  for (int64_t r = 0; r < v; ++r) {
    const int64_t s = start[r], e = start[r + 1];
    if (s == e) continue;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t k = s; k < e; ++k) {
      const T *row = dy + order[k] * h;
#pragma omp simd
      for (int64_t j = 0; j < h; ++j) acc[j] += to_f32(row[j]);
    }
    T *out = dw + r * h;
#pragma omp simd
    for (int64_t j = 0; j < h; ++j) out[j] = from_f32<T>(acc[j]);
  }
  return 0;
}

}  // namespace

// inputs: a, b (same shape, both fp32 or both bf16).  output: a + b.
MSLLM_EXPORT int ResidualAdd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                             void *) {
  if (nparam != 3) return kErrNParam;
  const int kind = storage_kind(dtypes, {0, 1, 2});
  if (kind < 0) return kErrDtype;
  return kind ? add_t<uint16_t>(params, ndims, shapes) : add_t<float>(params, ndims, shapes);
}

// inputs: weight [V, h], ids [...] (int32/int64).  output: [..., h] = weight[ids].
MSLLM_EXPORT int EmbeddingFwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                              void *) {
  if (nparam != 3) return kErrNParam;
  const int kind = storage_kind(dtypes, {0, 2});
  if (kind < 0) return kErrDtype;
  return kind ? embedding_fwd_t<uint16_t>(params, ndims, shapes, dtypes)
              : embedding_fwd_t<float>(params, ndims, shapes, dtypes);
}

// inputs: weight [V, h] (its shape only), ids [...], dy [..., h].  output: dweight [V, h].
MSLLM_EXPORT int EmbeddingBwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                              void *) {
  if (nparam != 4) return kErrNParam;
  const int kind = storage_kind(dtypes, {0, 2, 3});
  if (kind < 0) return kErrDtype;
  return kind ? embedding_bwd_t<uint16_t>(params, ndims, shapes, dtypes)
              : embedding_bwd_t<float>(params, ndims, shapes, dtypes);
}

// Split along the last axis into contiguous pieces: inputs x [..., W] and one sizes tensor per
// piece (only its length is read: it keys MindSpore's kernel cache per sections); outputs the k
// pieces [..., s_i]. Why: a piece of mint.narrow differentiates to a zero-filled full-size tensor
// per piece, summed by MindSpore's bf16 Add (~13 ns per element, 2 x 19 ms per layer for the
// ~55M model's QKV); this op's gradient is one concatenation.
MSLLM_EXPORT int SplitLast(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                           void *) {
  if (nparam < 3 || (nparam - 1) % 2 != 0) return kErrNParam;
  const int k = (nparam - 1) / 2;
  const size_t esize = is_f32(dtypes[0]) ? 4 : (is_bf16_dtype(dtypes[0]) ? 2 : 0);
  if (esize == 0 || ndims[0] < 1) return kErrDtype;
  const int64_t w = shapes[0][ndims[0] - 1];
  const int64_t rows = w > 0 ? numel(ndims[0], shapes[0]) / w : 0;
  int64_t total = 0;
  for (int i = 0; i < k; ++i) {
    const int o = 1 + k + i;
    if (std::strcmp(dtypes[o], dtypes[0]) != 0) return kErrDtype;
    const int64_t s = shapes[o][ndims[o] - 1];
    if (numel(ndims[o], shapes[o]) != rows * s || numel(ndims[1 + i], shapes[1 + i]) != s) return kErrShape;
    total += s;
  }
  if (total != w) return kErrShape;
  const char *x = static_cast<const char *>(params[0]);
  for (int64_t r = 0; r < rows; ++r) {
    int64_t off = 0;
    for (int i = 0; i < k; ++i) {
      const int o = 1 + k + i;
      const int64_t s = shapes[o][ndims[o] - 1];
      std::memcpy(static_cast<char *>(params[o]) + r * s * esize, x + (r * w + off) * esize,
                  static_cast<size_t>(s) * esize);
      off += s;
    }
  }
  return 0;
}

// bf16 <-> fp32 conversion: input x, output y of the other dtype (widening exact; narrowing to
// nearest even, NaN kept quiet). MindSpore 2.10's CPU Cast moves ~4-7 ns per element (a bf16
// step casts its attention inputs, its gradients to fp32 and its fp32 main parameters back).
MSLLM_EXPORT int CastFloat(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                           void *) {
  if (nparam != 2) return kErrNParam;
  const int64_t n = numel(ndims[0], shapes[0]);
  if (numel(ndims[1], shapes[1]) != n) return kErrShape;
  if (is_bf16_dtype(dtypes[0]) && is_f32(dtypes[1])) {
    const uint16_t *x = static_cast<const uint16_t *>(params[0]);
    float *y = static_cast<float *>(params[1]);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] = to_f32(x[i]);
    return 0;
  }
  if (is_f32(dtypes[0]) && is_bf16_dtype(dtypes[1])) {
    const float *x = static_cast<const float *>(params[0]);
    uint16_t *y = static_cast<uint16_t *>(params[1]);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] = from_f32<uint16_t>(x[i]);
    return 0;
  }
  return kErrDtype;
}

// The same conversion under one name per direction. MindSpore's graph mode (mindspore.jit) keys a
// Custom op's inferred output type by its function and input shapes: with both directions named
// CastFloat, a bf16 step with a widening and a narrowing cast of equal shapes got one output type
// for both ("For primitive[AddN], the input type must be same" in autograd).
MSLLM_EXPORT int CastToBf16(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                            void *stream, void *extra) {
  return CastFloat(nparam, params, ndims, shapes, dtypes, stream, extra);
}

MSLLM_EXPORT int CastToF32(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                           void *stream, void *extra) {
  return CastFloat(nparam, params, ndims, shapes, dtypes, stream, extra);
}

// Two copies of x: the two uses of the residual stream (its norm and its residual add) get
// their own tensors, so their gradients are summed by ResidualAdd in this op's backward instead
// of by MindSpore's bf16 Add in autograd (~12 ns per element).
MSLLM_EXPORT int Fork(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                      void *) {
  if (nparam != 3) return kErrNParam;
  const size_t esize = is_f32(dtypes[0]) ? 4 : (is_bf16_dtype(dtypes[0]) ? 2 : 0);
  if (esize == 0 || std::strcmp(dtypes[1], dtypes[0]) != 0 || std::strcmp(dtypes[2], dtypes[0]) != 0)
    return kErrDtype;
  const int64_t n = numel(ndims[0], shapes[0]);
  if (numel(ndims[1], shapes[1]) != n || numel(ndims[2], shapes[2]) != n) return kErrShape;
  std::memcpy(params[1], params[0], static_cast<size_t>(n) * esize);
  std::memcpy(params[2], params[0], static_cast<size_t>(n) * esize);
  return 0;
}

// Attention's head layout changes. SplitHeads: x [B, S, G, W] (per group g, the pieces' columns
// side by side: piece i is p_i heads of D columns, W = D * sum p_i) -> piece i as
// [B, G * p_i, S, D] (head g * p_i + h; p_i and D read from the output shapes). JoinHeads is the
// inverse: the pieces -> x [B, S, G, W] (G read from the output's shape). Each is the other's
// gradient. Both also take tiny int8 keys (SplitHeads one [p_i, D] per piece, JoinHeads one [G]),
// never read: MindSpore 2.10 reuses an AOT kernel, output count and shapes included, for equal
// input shapes, so the keys make each layout's inputs distinct. Why: the composed form (split, reshape, swapaxes) leaves strided views that
// MindSpore 2.10 makes contiguous before the next kernel at ~0.5 GB/s (8-9 ms per 4 MB copy on
// a 2-core Zen 4; 2 x 8 layers of them per step of the ~55M model, forward and backward); here
// each D-element head row is one memcpy. Any 2- or 4-byte dtype (fp32, bf16, fp16).
namespace {

size_t elem_size(const char *d) {
  return is_f32(d) ? 4 : (is_bf16_dtype(d) || std::strcmp(d, "float16") == 0 ? 2 : 0);
}

// split: x -> pieces when true, pieces -> x when false; x_at / first_piece: param indices.
int move_heads(void **params, int *ndims, int64_t **shapes, const char **dtypes, int x_at, int first_piece,
               int k, bool split) {
  const size_t es = elem_size(dtypes[x_at]);
  if (es == 0) return kErrDtype;
  if (ndims[x_at] != 4) return kErrShape;
  const int64_t b = shapes[x_at][0], s = shapes[x_at][1], groups = shapes[x_at][2], w = shapes[x_at][3];
  if (groups <= 0) return kErrShape;
  std::vector<int64_t> heads(k), offset(k);
  int64_t d = -1, total = 0;
  for (int i = 0; i < k; ++i) {
    const int o = first_piece + i;
    if (std::strcmp(dtypes[o], dtypes[x_at]) != 0) return kErrDtype;
    if (ndims[o] != 4 || shapes[o][0] != b || shapes[o][2] != s || shapes[o][1] % groups) return kErrShape;
    if (d >= 0 && shapes[o][3] != d) return kErrShape;
    d = shapes[o][3];
    heads[i] = shapes[o][1] / groups;
    offset[i] = total;
    total += heads[i] * d;
  }
  if (total != w) return kErrShape;
  const size_t row = static_cast<size_t>(d) * es;
  const int64_t xstride = groups * w * static_cast<int64_t>(es);
  char *x = static_cast<char *>(params[x_at]);
  for (int i = 0; i < k; ++i) {
    char *p = static_cast<char *>(params[first_piece + i]);
    const int64_t ph = heads[i], nh = groups * ph;
    for (int64_t bi = 0; bi < b; ++bi)
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t h = 0; h < ph; ++h) {
          char *pr = p + ((bi * nh + g * ph + h) * s) * row;
          char *xr = x + ((bi * s * groups + g) * w + offset[i] + h * d) * es;
          for (int64_t t = 0; t < s; ++t, pr += row, xr += xstride)
            split ? std::memcpy(pr, xr, row) : std::memcpy(xr, pr, row);
        }
  }
  return 0;
}

}  // namespace

MSLLM_EXPORT int SplitHeads(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                            void *) {
  if (nparam < 3 || (nparam - 1) % 2 != 0) return kErrNParam;  // x, one key per piece, the pieces
  const int k = (nparam - 1) / 2;
  return move_heads(params, ndims, shapes, dtypes, 0, 1 + k, k, true);
}

MSLLM_EXPORT int JoinHeads(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                           void *) {
  if (nparam < 3) return kErrNParam;  // the pieces, the group key, x
  return move_heads(params, ndims, shapes, dtypes, nparam - 1, 0, nparam - 2, false);
}

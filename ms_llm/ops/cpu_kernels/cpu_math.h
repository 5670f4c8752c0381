// What the kernel sources share (kernels.cpp, blas_kernels.cpp, blas_attention.cpp include it;
// both libraries' build keys hash it, see build.py): the error codes MindSpore sees, the
// dtype/shape/scalar readers of the AOT calling convention, and a vectorisable exp.
#pragma once

#include <cstdint>
#include <cstring>
#include <initializer_list>

namespace msllm {

// Non-zero kernel return codes (MindSpore raises on them).
constexpr int kErrDtype = 1;
constexpr int kErrShape = 2;
constexpr int kErrLabel = 3;
constexpr int kErrNParam = 4;
constexpr int kErrTooLarge = 5;  // a GEMM dimension does not fit OpenBLAS's 32-bit blasint

inline int64_t numel(int nd, const int64_t *s) {
  int64_t n = 1;
  for (int i = 0; i < nd; ++i) n *= s[i];
  return n;
}

inline bool is_f32(const char *d) { return std::strcmp(d, "float32") == 0 || std::strcmp(d, "float") == 0; }

inline bool is_bf16_dtype(const char *d) { return std::strcmp(d, "bfloat16") == 0; }

// Element access for kernels templated on their storage type T: float, or uint16_t holding bf16
// bits (widened exactly; stored rounded to nearest even, NaN kept quiet). The arithmetic is fp32.
inline float to_f32(float v) { return v; }
inline float to_f32(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
template <class T> inline T from_f32(float f);
template <> inline float from_f32<float>(float f) { return f; }
template <> inline uint16_t from_f32<uint16_t>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// 0 = every listed dtype fp32, 1 = every one bf16, -1 = anything else.
inline int storage_kind(const char **dtypes, std::initializer_list<int> which) {
  bool f = true, b = true;
  for (int i : which) {
    f = f && is_f32(dtypes[i]);
    b = b && is_bf16_dtype(dtypes[i]);
  }
  return f ? 0 : (b ? 1 : -1);
}

inline bool is_i32(const char *d) { return std::strcmp(d, "int32") == 0; }

inline bool is_i64(const char *d) { return std::strcmp(d, "int64") == 0 || std::strcmp(d, "int") == 0; }

// Read a scalar (0-d or 1-element tensor) of any common dtype as double.
inline bool read_scalar(const void *p, const char *d, double *out) {
  if (is_f32(d)) {
    *out = *static_cast<const float *>(p);
  } else if (std::strcmp(d, "float64") == 0) {
    *out = *static_cast<const double *>(p);
  } else if (is_i64(d)) {
    *out = static_cast<double>(*static_cast<const int64_t *>(p));
  } else if (is_i32(d)) {
    *out = *static_cast<const int32_t *>(p);
  } else {
    return false;
  }
  return true;
}

// exp(x) for fp32, branch-free so that GCC vectorises the loops that call it (Cephes expf
// polynomial, about 1 ulp on the clamped range). Returns 0 below -87.34 (where expf would be
// subnormal), saturates at exp(88.38) above, and propagates NaN.
inline float exp_f(float x) {
  const float kHi = 88.3762626647949f;
  const float kLo = -87.3365447504f;
  float xc = x > kHi ? kHi : x;
  xc = xc < kLo ? kLo : xc;
  // n = round(x / ln2) via the 1.5 * 2^23 trick (exact round-to-nearest for |v| < 2^22).
  const float kMagic = 12582912.0f;
  float t = xc * 1.44269504088896341f + kMagic;
  float n = t - kMagic;
  int32_t ni;
  std::memcpy(&ni, &t, sizeof(ni));
  ni -= 0x4B400000;
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500E-4f;
  p = p * r + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  float e = p * r * r + r + 1.0f;
  int32_t bits = (ni + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  float res = e * scale;
  return x < kLo ? 0.0f : res;
}

}  // namespace msllm

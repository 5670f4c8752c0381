// Math shared by the two kernel libraries (kernels.cpp and blas_attention.cpp include it; both
// build keys hash it, see build.py).
#pragma once

#include <cstdint>
#include <cstring>

namespace msllm {

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

// The s16 layout's plain C++ kernel (s16.h), the definition every build
// matches bit for bit; in the kernel core, so the C++ drivers check the
// SIMD builds against it. Built without FMA contraction (the baseline ISA):
// the products and sums below round exactly as written.
#include <cmath>

#include "linear/s16.h"

namespace paged::cpu::linear {

namespace isa_scalar {
void s16_rows(const S16Args& s, int64_t n0, int64_t n1) {
  const LinearArgs& a = *s.a;
  const int64_t K = a.K, nb = K / kBlock, nh = K / kS16Half;
  for (int64_t r = 0; r < a.M; ++r) {
    const int8_t* hi = a.x8 + r * K;
    const int8_t* lo = a.x8_lo ? a.x8_lo + r * K : nullptr;
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* w = s.row_codes(n);
      float acc[kLanes] = {};
      for (int64_t b = 0; b < nb; ++b) {
        const float dx = a.x8_scale[r * nb + b];
        const float scale[2] = {a.d[n * nh + 2 * b] * dx, a.d[n * nh + 2 * b + 1] * dx};
        for (int l = 0; l < kLanes; ++l) {
          int32_t isum = 0;
          for (int j = 0; j < 4; ++j) {
            const int64_t k = b * kBlock + 4 * l + j;
            isum += int32_t(w[k]) * (lo ? hi[k] * 256 + lo[k] : hi[k]);
          }
          acc[l] = std::fma(scale[l / 4], float(isum), acc[l]);
        }
      }
      float out = hsum8(acc);
      if (a.m) {
        float t[kLanes] = {};
        for (int64_t h = 0; h < nh; ++h) t[h % kLanes] = std::fma(a.m[n * nh + h], s.xs[r * nh + h], t[h % kLanes]);
        out = out + hsum8(t);
      }
      a.out[r * a.N + n] = out;
    }
  }
}
}  // namespace isa_scalar

}  // namespace paged::cpu::linear

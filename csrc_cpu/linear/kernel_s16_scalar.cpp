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
      float e[2] = {};  // the chains of first and second halves
      for (int64_t b = 0; b < nb; ++b) {
        const float dx = a.x8_scale[r * nb + b];
        for (int h = 0; h < 2; ++h) {
          const int64_t g = 2 * b + h;  // the half's scale
          int32_t isum = 0;
          for (int64_t k = g * kS16Half; k < (g + 1) * kS16Half; ++k)
            isum += int32_t(w[k]) * (lo ? hi[k] * 256 + lo[k] : hi[k]);
          e[h] = std::fma(a.d[n * nh + g] * dx, float(isum), e[h]);
        }
      }
      float out = e[0] + e[1];
      if (a.m) {  // eight chains, half g in chain g % 8
        float t[kLanes] = {};
        for (int64_t g = 0; g < nh; ++g) t[g % kLanes] = std::fma(a.m[n * nh + g], s.xs[r * nh + g], t[g % kLanes]);
        out = out + hsum8(t);
      }
      a.out[r * a.N + n] = out;
    }
  }
}
}  // namespace isa_scalar

}  // namespace paged::cpu::linear

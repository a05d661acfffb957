// Lane-major float32 attention of prompt rows (prompt_lanes.h).
//
// Work items, tiles of 16 query vectors and steps of 32 keys as
// prompt_tiles_avx512.inc lays them out (the bfloat16 kernel's skeleton).
// The 16 vectors of a tile are the lanes, so nothing is reduced across lanes:
//   S^T = K Q^T      per key, a chain of fmas over d: Q^T[d] (16 vectors)
//                    times the key's element d broadcast from memory;
//   softmax          per lane over the step's 32 keys: masked max, exp, sum;
//   O^T += V^T P^T   per dim, a chain of fmas over the keys: P^T[key] times
//                    the value's element broadcast from memory.
// Every instruction of the two products is one fma on 16 (vector, key) or
// (vector, dim) pairs, where the shared float32 kernel also spends per key
// a horizontal sum of 16 lanes and a broadcast of each probability. A step's
// K and V are converted to float32 once for all the item's tiles.
#include "attention/prompt_lanes.h"

#include <immintrin.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "arch/target.h"
#include "linear/aligned.h"

PAGED_TARGET_BEGIN("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC bug 105593, as in the AVX-512 builds
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace paged::cpu::attn::isa_avx512_lanes {
namespace {

#include "arch/x86/attention/vec_avx512.inc"  // Vec: the cache loads and exp of the float32 kernel

#include "arch/x86/attention/prompt_tiles_avx512.inc"  // Item, ItemTiles, LaneState, lazy_max, run_items

constexpr int kKeyBlock = 8;   // keys whose scores share each load of Q^T[d]
constexpr int kDimBlock = 16;  // dims whose outputs share each load of P^T[key]
// Below this many (query vector, key) pairs a call runs on the calling thread.
constexpr int64_t kMinParallelWork = 1 << 13;
static_assert(kStep % kKeyBlock == 0, "score blocks tile a step");

// Per-thread scratch, reused across items and calls.
struct Scratch : LaneState {
  AlignedVector<float> qt;   // [tile][dim][vector]: scaled Q^T
  AlignedVector<float> k;    // [key][dim]: a step's K in float32
  AlignedVector<float> v;    // [key][dim]: a step's V in float32
  AlignedVector<float> acc;  // [tile][dim][vector]: O^T
  alignas(64) float s[kStep][kTile];  // S^T, then P^T, of one tile and step
};

class ItemRunner : public ItemTiles<ItemRunner> {
 public:
  ItemRunner(const AttnArgs& a, const Item& it, Scratch& sc) : ItemTiles(a, it), sc_(sc) {}

 private:
  friend class ItemTiles<ItemRunner>;
  // Q^T (scaled; padding lanes zero), visible ranges, running state.
  void prepare() {
    sc_.qt.resize(size_t(tiles_ * D_ * kTile));
    sc_.acc.assign(size_t(tiles_ * D_ * kTile), 0.0f);
    set_ranges(sc_);
    for (int64_t t = 0; t < tiles_; ++t)
      for (int64_t d0 = 0; d0 < D_; d0 += 16) {  // 16 dims of 16 vectors, transposed
        __m512i r[16];
        for (int64_t i = 0; i < kTile; ++i)
          r[i] = i < rows(t) ? _mm512_castps_si512(scaled_query16(it_.first + t * kTile + i, d0))
                             : _mm512_setzero_si512();  // padding lanes: zero queries
        transpose16(r);  // r[k]: dim d0 + k of the 16 vectors
        float* qt = sc_.qt.data() + (t * D_ + d0) * kTile;
        for (int k = 0; k < 16; ++k) _mm512_store_si512(qt + k * kTile, r[k]);
      }
  }

  // Keys [s0, s0 + 32) in float32; keys outside the item's [lo_, hi_) are zeros.
  template <DType T>
  void convert_step(int64_t s0) {
    sc_.k.resize(size_t(kStep * D_));
    sc_.v.resize(size_t(kStep * D_));
    for (int64_t n = 0; n < kStep; ++n) {
      const int64_t pos = s0 + n;
      float* k = sc_.k.data() + n * D_;
      float* v = sc_.v.data() + n * D_;
      if (pos < lo_ || pos >= hi_) {
        std::fill(k, k + D_, 0.0f);
        std::fill(v, v + D_, 0.0f);
        continue;
      }
      const char* kr = row(a_.key_cache, pos);
      const char* vr = row(a_.value_cache, pos);
      for (int64_t d = 0; d < D_; d += 16) {
        _mm512_store_ps(k + d, load16<T>(kr, d));
        _mm512_store_ps(v + d, load16<T>(vr, d));
      }
    }
  }

  // The step's keys [n_lo, n_hi) that some vector of tile t sees (outside
  // them every lane's probability is 0, and skipping a 0 * v changes no bit).
  void attend(int64_t t, int64_t s0) {
    const int64_t n_lo = std::max<int64_t>(0, tile_lo_[t] - s0) / kKeyBlock * kKeyBlock;
    const int64_t n_hi = std::min<int64_t>(kStep, tile_hi_[t] - s0);
    scores(t, n_lo, n_hi);
    const __m512 alpha = softmax(t, s0);
    accumulate(t, alpha, n_lo, n_hi);
  }

  // S^T[n] = sum over d of Q^T[d] * k_n[d], a chain of fmas in d order;
  // blocks of keys no vector sees are -inf.
  void scores(int64_t t, int64_t n_lo, int64_t n_hi) {
    const float* qt = sc_.qt.data() + t * D_ * kTile;
    for (int64_t n0 = 0; n0 < kStep; n0 += kKeyBlock) {
      if (n0 < n_lo || n0 >= n_hi) {
        for (int j = 0; j < kKeyBlock; ++j) _mm512_store_ps(sc_.s[n0 + j], _mm512_set1_ps(kNegInf));
        continue;
      }
      const float* k = sc_.k.data() + n0 * D_;
      __m512 acc[kKeyBlock];
      for (int j = 0; j < kKeyBlock; ++j) acc[j] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D_; ++d) {
        const __m512 q = _mm512_load_ps(qt + d * kTile);
        for (int j = 0; j < kKeyBlock; ++j) acc[j] = _mm512_fmadd_ps(q, _mm512_set1_ps(k[j * D_ + d]), acc[j]);
      }
      for (int j = 0; j < kKeyBlock; ++j) _mm512_store_ps(sc_.s[n0 + j], acc[j]);
    }
  }

  // The step's probabilities (P^T, in place of S^T), m and l of the tile's vectors; returns alpha.
  __m512 softmax(int64_t t, int64_t s0) {
    const __m512 mx = mask_and_max(sc_, t, s0, sc_.s);
    const __m512 m_old = _mm512_load_ps(sc_.m[t]);
    const __m512 m = lazy_max(mx, m_old);
    const __mmask16 none = _mm512_cmp_ps_mask(m, _mm512_set1_ps(kNegInf), _CMP_EQ_OQ);  // nothing visible so far
    const __m512 alpha = _mm512_mask_mov_ps(Vec::exp(_mm512_sub_ps(m_old, m)), none, _mm512_set1_ps(1.0f));
    const __m512 neg_m = _mm512_maskz_sub_ps(static_cast<__mmask16>(~none), _mm512_setzero_ps(), m);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t n = 0; n < kStep; ++n) {
      const __m512 p = Vec::exp(_mm512_add_ps(_mm512_load_ps(sc_.s[n]), neg_m));
      _mm512_store_ps(sc_.s[n], p);
      sum = _mm512_add_ps(sum, p);
    }
    _mm512_store_ps(sc_.l[t], _mm512_fmadd_ps(_mm512_load_ps(sc_.l[t]), alpha, sum));
    _mm512_store_ps(sc_.m[t], m);
    return alpha;
  }

  // O^T = alpha O^T + V^T P^T over keys [n_lo, n_hi), kDimBlock dims at a time.
  void accumulate(int64_t t, __m512 alpha, int64_t n_lo, int64_t n_hi) {
    float* acc = sc_.acc.data() + t * D_ * kTile;
    const bool rescale = _mm512_cmp_ps_mask(alpha, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ);  // some vector's max moved
    for (int64_t d0 = 0; d0 < D_; d0 += kDimBlock) {
      __m512 o[kDimBlock];
      for (int e = 0; e < kDimBlock; ++e) {
        o[e] = _mm512_load_ps(acc + (d0 + e) * kTile);
        if (rescale) o[e] = _mm512_mul_ps(o[e], alpha);
      }
      const float* v = sc_.v.data() + d0;
      for (int64_t n = n_lo; n < n_hi; ++n) {
        const __m512 p = _mm512_load_ps(sc_.s[n]);
        for (int e = 0; e < kDimBlock; ++e) o[e] = _mm512_fmadd_ps(p, _mm512_set1_ps(v[n * D_ + e]), o[e]);
      }
      for (int e = 0; e < kDimBlock; ++e) _mm512_store_ps(acc + (d0 + e) * kTile, o[e]);
    }
  }

  void finish() { write_outputs(sc_, sc_.acc.data()); }

  Scratch& sc_;
};

}  // namespace

void prompt_attention(const AttnArgs& a) {
  run_items<ItemRunner, Scratch>(a, kMinParallelWork);
}

}  // namespace paged::cpu::attn::isa_avx512_lanes

#pragma GCC diagnostic pop
PAGED_TARGET_END()

// AMX-BF16 attention of prompt rows (prompt_bf16.h).
//
// Work items, tiles of 16 query vectors and steps of 32 keys as
// prompt_tiles_avx512.inc lays them out. Everything runs transposed, keys
// (or dims) in tile rows and the 16 query vectors in the lanes, so the
// softmax is vertical (no horizontal reductions):
//   S^T = K Q^T      A: K rows as they are (bf16, 32 dims), B: Q^T pairs
//                    (made once per item by a 16 x 16 dword transpose);
//   softmax          per lane over the 32 rows: masked max, exp, sum;
//   O^T += V^T P^T   A: V^T (two key rows interleaved into pairs, then
//                    transposed), B: P^T pairs (two rows of P^T
//                    interleaved); O^T lives in float32 C tiles, 16 dims
//                    x 16 vectors, loaded and stored back per step.
// K and V of a step are converted once for all the item's tiles; the
// running max is the lazy one of prompt_tiles_avx512.inc.
#include "attention/prompt_bf16.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "arch/x86/amx/amx_tiles.h"
#include "linear/aligned.h"

PAGED_TARGET_BEGIN(PAGED_AMX_ISA)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC bug 105593, as in the AVX-512 builds
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace paged::cpu::attn::isa_amx_bf16 {
namespace {

#include "arch/x86/attention/vec_avx512.inc"  // Vec: the float32 kernel's cache loads

#include "arch/x86/attention/prompt_tiles_avx512.inc"  // Item, ItemTiles, LaneState, lazy_max, run_items

namespace amx = linear::amx;

// kTile (16) is also the keys per half step and the rows of every tile; a
// step (32 keys) is one bfloat16 pair row of P^T per 2 keys.
constexpr int64_t kTileElems = 512;  // bfloat16 elements of a 1 KB tile (or 256 floats)
// Below this many (query vector, key) pairs a call runs on the calling thread.
constexpr int64_t kMinParallelWork = 1 << 13;
constexpr amx::TileConfig kConfig = amx::full_tiles_config();

// Per-thread scratch, reused across items and calls.
struct Scratch : LaneState {
  AlignedVector<uint16_t> qt;  // [tile][32 dims][pair][vector][2]: Q^T B tiles
  AlignedVector<uint16_t> k;   // [key half][32 dims][key][32]: a step's K A tiles
  AlignedVector<uint16_t> vt;  // [16 dims][dim][key pair][2]: a step's V^T A tiles
  AlignedVector<float> acc;    // [tile][16 dims][dim][vector]: O^T
  alignas(64) float s[kStep][kTile];       // S^T of one tile and step
  alignas(64) uint16_t pt[kTile][2 * kTile];  // P^T pairs: [key pair][vector][2]
};

// 32 floats as 32 bfloat16 (round to nearest even; words 0-15 from lo).
inline __m512i bf16x32(__m512 lo, __m512 hi) { return (__m512i)_mm512_cvtne2ps_pbh(hi, lo); }

using amx::bf16_pairs;

// e^x for x <= 88 (0 below -87.3, and for -inf): 2^n e^r with |r| <= ln 2 / 2 and a
// degree-5 Taylor polynomial (relative error < 3e-6, far below the bfloat16
// rounding of the probabilities); vscalefps puts the exponent in. e^0 is 1 exactly.
inline __m512 exp_lanes(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f);
  const __mmask16 ok = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 120);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(ok, _mm512_scalef_ps(p, n));
}

class ItemRunner : public ItemTiles<ItemRunner> {
 public:
  ItemRunner(const AttnArgs& a, const Item& it, Scratch& sc) : ItemTiles(a, it), sc_(sc) {}

 private:
  friend class ItemTiles<ItemRunner>;
  // The tile configuration; Q^T tiles (scaled, rounded), visible ranges, running state.
  void prepare() {
    amx::ensure_config(kConfig);
    const int64_t chunks = D_ / 32;
    sc_.qt.resize(size_t(tiles_ * chunks * kTileElems));
    sc_.acc.assign(size_t(tiles_ * kTile * D_), 0.0f);
    set_ranges(sc_);
    for (int64_t t = 0; t < tiles_; ++t) {
      for (int64_t c = 0; c < chunks; ++c) {
        __m512i r[16];
        for (int64_t i = 0; i < kTile; ++i) {
          const int64_t v = it_.first + t * kTile + i;
          r[i] = i < rows(t) ? bf16x32(scaled_query16(v, 32 * c), scaled_query16(v, 32 * c + 16))
                             : _mm512_setzero_si512();
        }
        transpose16(r);  // row p: dims 2p, 2p + 1 of the 16 vectors
        uint16_t* dst = sc_.qt.data() + (t * chunks + c) * kTileElems;
        for (int p = 0; p < kTile; ++p) _mm512_store_si512(dst + 32 * p, r[p]);
      }
    }
  }

  // Keys [s0, s0 + 32) as A tiles; keys outside the item's [lo_, hi_) are zeros (never read).
  template <DType T>
  void convert_step(int64_t s0) {
    const int64_t chunks = D_ / 32, vchunks = D_ / 16;
    sc_.k.resize(size_t(2 * chunks * kTileElems));
    sc_.vt.resize(size_t(vchunks * kTileElems));
    auto cached = [&](int64_t pos) { return pos >= lo_ && pos < hi_; };
    for (int64_t n = 0; n < kStep; ++n) {  // K: tile row n % 16 of half n / 16, 32 dims per chunk
      const int64_t pos = s0 + n;
      const char* k = cached(pos) ? row(a_.key_cache, pos) : nullptr;
      for (int64_t c = 0; c < chunks; ++c)
        _mm512_store_si512(sc_.k.data() + ((n / kTile) * chunks + c) * kTileElems + (n % kTile) * 32,
                           k ? bf16x32(load16<T>(k, 32 * c), load16<T>(k, 32 * c + 16)) : _mm512_setzero_si512());
    }
    for (int64_t j = 0; j < vchunks; ++j) {  // V^T: key pairs of 16 dims, transposed to dims x pairs
      __m512i r[16];
      for (int kp = 0; kp < kTile; ++kp) {
        const int64_t p0 = s0 + 2 * kp, p1 = p0 + 1;
        const __m512 x0 = cached(p0) ? load16<T>(row(a_.value_cache, p0), 16 * j) : _mm512_setzero_ps();
        const __m512 x1 = cached(p1) ? load16<T>(row(a_.value_cache, p1), 16 * j) : _mm512_setzero_ps();
        r[kp] = bf16_pairs(x0, x1);
      }
      transpose16(r);
      uint16_t* dst = sc_.vt.data() + j * kTileElems;
      for (int d = 0; d < kTile; ++d) _mm512_store_si512(dst + 32 * d, r[d]);
    }
  }

  void attend(int64_t t, int64_t s0) {
    const int64_t chunks = D_ / 32;
    const uint16_t* qt = sc_.qt.data() + t * chunks * kTileElems;
    amx::tile_zero<4>();
    amx::tile_zero<5>();
    for (int64_t c = 0; c < chunks; ++c) {
      amx::tile_load<0>(sc_.k.data() + c * kTileElems, 64);
      amx::tile_load<1>(sc_.k.data() + (chunks + c) * kTileElems, 64);
      amx::tile_load<2>(qt + c * kTileElems, 64);
      amx::tile_dot_bf16<4, 0, 2>();
      amx::tile_dot_bf16<5, 1, 2>();
    }
    amx::tile_store<4>(&sc_.s[0][0], kTile * sizeof(float));
    amx::tile_store<5>(&sc_.s[kTile][0], kTile * sizeof(float));
    const __m512 alpha = softmax(t, s0);
    accumulate(t, alpha);
  }

  // The step's probabilities (P^T pairs), m and l of the tile's vectors; returns alpha.
  __m512 softmax(int64_t t, int64_t s0) {
    const __m512 mx = mask_and_max(sc_, t, s0, sc_.s);
    const __m512 m_old = _mm512_load_ps(sc_.m[t]);
    const __m512 m = lazy_max(mx, m_old);
    const __mmask16 none = _mm512_cmp_ps_mask(m, _mm512_set1_ps(kNegInf), _CMP_EQ_OQ);  // nothing visible so far
    const __m512 alpha = _mm512_mask_mov_ps(exp_lanes(_mm512_sub_ps(m_old, m)), none, _mm512_set1_ps(1.0f));
    const __m512 neg_m = _mm512_maskz_sub_ps(static_cast<__mmask16>(~none), _mm512_setzero_ps(), m);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t n = 0; n < kStep; n += 2) {
      const __m512i pair = bf16_pairs(exp_lanes(_mm512_add_ps(_mm512_load_ps(sc_.s[n]), neg_m)),
                                      exp_lanes(_mm512_add_ps(_mm512_load_ps(sc_.s[n + 1]), neg_m)));
      _mm512_store_si512(sc_.pt[n / 2], pair);
      // l sums the rounded probabilities, the weights V gets: a vector's
      // output is a convex combination of its values
      sum = _mm512_add_ps(_mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16))),
                          _mm512_castsi512_ps(_mm512_and_si512(pair, _mm512_set1_epi32(int32_t(0xFFFF0000u)))));
    }
    _mm512_store_ps(sc_.l[t], _mm512_fmadd_ps(_mm512_load_ps(sc_.l[t]), alpha, sum));
    _mm512_store_ps(sc_.m[t], m);
    return alpha;
  }

  // O^T = alpha O^T + V^T P^T for the tile's 16 vectors.
  void accumulate(int64_t t, __m512 alpha) {
    float* acc = sc_.acc.data() + t * kTile * D_;
    if (_mm512_cmp_ps_mask(alpha, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ))  // some vector's max moved
      for (int64_t d = 0; d < D_; ++d) _mm512_store_ps(acc + 16 * d, _mm512_mul_ps(_mm512_load_ps(acc + 16 * d), alpha));
    const int64_t vchunks = D_ / 16;
    const uint16_t* vt = sc_.vt.data();
    amx::tile_load<0>(&sc_.pt[0][0], 64);
    for (int64_t j = 0; j < vchunks; j += 4) {  // 64 dims (or the last 32) per pass: 4 C tiles
      float* a0 = acc + j * kTileElems / 2;
      const bool four = j + 4 <= vchunks;
      amx::tile_load<4>(a0, 64);
      amx::tile_load<5>(a0 + 256, 64);
      amx::tile_load<1>(vt + j * kTileElems, 64);
      amx::tile_load<2>(vt + (j + 1) * kTileElems, 64);
      amx::tile_dot_bf16<4, 1, 0>();
      amx::tile_dot_bf16<5, 2, 0>();
      amx::tile_store<4>(a0, 64);
      amx::tile_store<5>(a0 + 256, 64);
      if (!four) break;
      amx::tile_load<6>(a0 + 512, 64);
      amx::tile_load<7>(a0 + 768, 64);
      amx::tile_load<1>(vt + (j + 2) * kTileElems, 64);
      amx::tile_load<2>(vt + (j + 3) * kTileElems, 64);
      amx::tile_dot_bf16<6, 1, 0>();
      amx::tile_dot_bf16<7, 2, 0>();
      amx::tile_store<6>(a0 + 512, 64);
      amx::tile_store<7>(a0 + 768, 64);
    }
  }

  void finish() { write_outputs(sc_, sc_.acc.data()); }

  Scratch& sc_;
};

}  // namespace

void prompt_attention(const AttnArgs& a) {
  run_items<ItemRunner, Scratch>(a, kMinParallelWork);
}

}  // namespace paged::cpu::attn::isa_amx_bf16

#pragma GCC diagnostic pop
PAGED_TARGET_END()

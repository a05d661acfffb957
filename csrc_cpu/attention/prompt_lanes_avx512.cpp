// Lane-major float32 attention of prompt rows (prompt_lanes.h).
//
// Work item: one (sequence, kv head) and up to kTilesPerItem tiles of 16
// query vectors (query rows x the kv head's query heads, row by row), over
// the union of the tiles' visible keys in steps of 32 keys aligned to
// absolute positions, so a vector meets the same steps in any tile, chunk or
// batch. The 16 vectors of a tile are the lanes, so nothing is reduced
// across lanes:
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

#include <algorithm>
#include <limits>
#include <vector>

#include "isa_select.h"
#include "linear/aligned.h"

#if defined(PAGED_ISA_X86)

#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")

namespace paged::cpu::attn::isa_avx512_lanes {
namespace {

#include "attention/vec_avx512.inc"  // Vec: the cache loads and exp of the float32 kernel

constexpr int kTile = 16;         // query vectors per tile (the lanes)
constexpr int64_t kStep = 32;     // keys per online-softmax step
constexpr int kKeyBlock = 8;      // keys whose scores share each load of Q^T[d]
constexpr int kDimBlock = 16;     // dims whose outputs share each load of P^T[key]
constexpr int kTilesPerItem = 4;  // tiles sharing one conversion of each step's K and V
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLazyMax = 8.0f;  // the running max moves when a step's exceeds it by more
// Below this many (query vector, key) pairs a call runs on the calling thread.
constexpr int64_t kMinParallelWork = 1 << 13;
static_assert(kStep % kKeyBlock == 0, "score blocks tile a step");

struct Item {
  int64_t seq, kv_head, first, count;  // query vectors [first, first + count) of (seq, kv head)
};

// Per-thread scratch, reused across items and calls.
struct Scratch {
  AlignedVector<float> qt;   // [tile][dim][vector]: scaled Q^T
  AlignedVector<float> k;    // [key][dim]: a step's K in float32
  AlignedVector<float> v;    // [key][dim]: a step's V in float32
  AlignedVector<float> acc;  // [tile][dim][vector]: O^T
  alignas(64) float s[kStep][kTile];  // S^T, then P^T, of one tile and step
  alignas(64) float m[kTilesPerItem][kTile], l[kTilesPerItem][kTile];
  alignas(64) int32_t lo[kTilesPerItem][kTile], hi[kTilesPerItem][kTile];  // visible keys [lo, hi)
};

template <DType T>
inline __m512 load16(const char* row, int64_t d) {
  if constexpr (T == DType::F32) return Vec::load(reinterpret_cast<const float*>(row) + d);
  else if constexpr (T == DType::BF16) return Vec::load_bf16(reinterpret_cast<const uint16_t*>(row) + d);
  else return Vec::load_f16(reinterpret_cast<const uint16_t*>(row) + d);
}

class ItemRunner {
 public:
  ItemRunner(const AttnArgs& a, const Item& it, Scratch& sc) : a_(a), it_(it), sc_(sc) {
    D_ = a.head_size;
    G_ = a.num_heads / a.num_kv_heads;
    qlen_ = a.query_start_loc[it.seq + 1] - a.query_start_loc[it.seq];
    len_ = a.seq_lens[it.seq];
    tiles_ = (it.count + kTile - 1) / kTile;
    table_ = a.block_tables + it.seq * a.table_stride;
    row_bytes_ = cache_row_bytes(a.cache_dtype, D_);
  }

  template <DType T>
  void run() {
    prepare();
    for (int64_t s0 = lo_ / kStep * kStep; s0 < hi_; s0 += kStep) {
      convert_step<T>(s0);
      for (int64_t t = 0; t < tiles_; ++t)
        if (tile_lo_[t] < s0 + kStep && tile_hi_[t] > s0) attend(t, s0);
    }
    finish();
  }

 private:
  int64_t rows(int64_t t) const { return std::min<int64_t>(kTile, it_.count - t * kTile); }
  const char* row(const void* cache, int64_t pos) const {
    const int64_t b = pos / a_.block_size;
    return static_cast<const char*>(cache) +
           ((int64_t(table_[b]) * a_.num_kv_heads + it_.kv_head) * a_.block_size + pos % a_.block_size) * row_bytes_;
  }
  // element offset of the item's vector v in query / out ([T, H, D])
  int64_t vector_offset(int64_t v) const {
    return ((a_.query_start_loc[it_.seq] + v / G_) * a_.num_heads + it_.kv_head * G_ + v % G_) * D_;
  }

  // Q^T (scaled), visible ranges, running state.
  void prepare() {
    sc_.qt.assign(size_t(tiles_ * D_ * kTile), 0.0f);  // padding lanes: zero queries
    sc_.acc.assign(size_t(tiles_ * D_ * kTile), 0.0f);
    lo_ = std::numeric_limits<int64_t>::max();
    hi_ = 0;
    for (int64_t t = 0; t < tiles_; ++t) {
      tile_lo_[t] = std::numeric_limits<int64_t>::max();
      tile_hi_[t] = 0;
      max_lo_[t] = 0;
      min_hi_[t] = std::numeric_limits<int64_t>::max();
      for (int64_t i = 0; i < kTile; ++i) {
        sc_.m[t][i] = kNegInf, sc_.l[t][i] = 0.0f;
        sc_.lo[t][i] = std::numeric_limits<int32_t>::max(), sc_.hi[t][i] = 0;  // padding: sees nothing
      }
      float* qt = sc_.qt.data() + t * D_ * kTile;
      for (int64_t i = 0; i < rows(t); ++i) {
        const int64_t v = it_.first + t * kTile + i, pos = len_ - qlen_ + v / G_;
        const int64_t lo = a_.sliding_window ? std::max<int64_t>(0, pos - a_.sliding_window + 1) : 0;
        sc_.lo[t][i] = int32_t(lo), sc_.hi[t][i] = int32_t(pos + 1);
        tile_lo_[t] = std::min(tile_lo_[t], lo), tile_hi_[t] = std::max(tile_hi_[t], pos + 1);
        max_lo_[t] = std::max(max_lo_[t], lo), min_hi_[t] = std::min(min_hi_[t], pos + 1);
        const int64_t src = vector_offset(v);
        for (int64_t d = 0; d < D_; ++d) qt[d * kTile + i] = load_scalar(a_.query, src + d, a_.dtype) * a_.scale;
      }
      if (rows(t) < kTile) max_lo_[t] = std::numeric_limits<int64_t>::max();  // padding lanes: always masked
      lo_ = std::min(lo_, tile_lo_[t]), hi_ = std::max(hi_, tile_hi_[t]);
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

  void attend(int64_t t, int64_t s0) {
    scores(t);
    const __m512 alpha = softmax(t, s0);
    accumulate(t, alpha);
  }

  // S^T[n] = sum over d of Q^T[d] * k_n[d], a chain of fmas in d order.
  void scores(int64_t t) {
    const float* qt = sc_.qt.data() + t * D_ * kTile;
    for (int64_t n0 = 0; n0 < kStep; n0 += kKeyBlock) {
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
    const __m512 neg_inf = _mm512_set1_ps(kNegInf);
    if (s0 < max_lo_[t] || s0 + kStep > min_hi_[t]) {  // some vector's window or causal edge crosses the step
      const __m512i lo = _mm512_load_si512(sc_.lo[t]), hi = _mm512_load_si512(sc_.hi[t]);
      for (int64_t n = 0; n < kStep; ++n) {
        const __m512i pos = _mm512_set1_epi32(int32_t(s0 + n));
        const __mmask16 seen = _mm512_cmple_epi32_mask(lo, pos) & _mm512_cmpgt_epi32_mask(hi, pos);
        _mm512_store_ps(sc_.s[n], _mm512_mask_mov_ps(neg_inf, seen, _mm512_load_ps(sc_.s[n])));
      }
    }
    __m512 mx = _mm512_load_ps(sc_.s[0]);
    for (int64_t n = 1; n < kStep; ++n) mx = _mm512_max_ps(mx, _mm512_load_ps(sc_.s[n]));
    const __m512 m_old = _mm512_load_ps(sc_.m[t]);
    const __m512 m = _mm512_mask_mov_ps(m_old, _mm512_cmp_ps_mask(mx, _mm512_add_ps(m_old, _mm512_set1_ps(kLazyMax)),
                                                                  _CMP_GT_OQ), mx);
    const __mmask16 none = _mm512_cmp_ps_mask(m, neg_inf, _CMP_EQ_OQ);  // nothing visible so far
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

  // O^T = alpha O^T + V^T P^T for the tile's 16 vectors, kDimBlock dims at a time.
  void accumulate(int64_t t, __m512 alpha) {
    float* acc = sc_.acc.data() + t * D_ * kTile;
    const bool rescale = _mm512_cmp_ps_mask(alpha, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ);  // some vector's max moved
    for (int64_t d0 = 0; d0 < D_; d0 += kDimBlock) {
      __m512 o[kDimBlock];
      for (int e = 0; e < kDimBlock; ++e) {
        o[e] = _mm512_load_ps(acc + (d0 + e) * kTile);
        if (rescale) o[e] = _mm512_mul_ps(o[e], alpha);
      }
      const float* v = sc_.v.data() + d0;
      for (int64_t n = 0; n < kStep; ++n) {
        const __m512 p = _mm512_load_ps(sc_.s[n]);
        for (int e = 0; e < kDimBlock; ++e) o[e] = _mm512_fmadd_ps(p, _mm512_set1_ps(v[n * D_ + e]), o[e]);
      }
      for (int e = 0; e < kDimBlock; ++e) _mm512_store_ps(acc + (d0 + e) * kTile, o[e]);
    }
  }

  // out = O / l, lane by lane back into the vectors' rows.
  void finish() {
    alignas(64) float buf[kTile];
    for (int64_t t = 0; t < tiles_; ++t) {
      const __m512 l = _mm512_load_ps(sc_.l[t]);
      const __mmask16 seen = _mm512_cmp_ps_mask(l, _mm512_setzero_ps(), _CMP_GT_OQ);
      const float* acc = sc_.acc.data() + t * D_ * kTile;
      for (int64_t d = 0; d < D_; ++d) {
        _mm512_store_ps(buf, _mm512_maskz_div_ps(seen, _mm512_load_ps(acc + d * kTile), l));
        for (int64_t i = 0; i < rows(t); ++i)
          store_scalar(a_.out, vector_offset(it_.first + t * kTile + i) + d, a_.dtype, buf[i]);
      }
    }
  }

  const AttnArgs& a_;
  const Item& it_;
  Scratch& sc_;
  int64_t D_, G_, qlen_, len_, tiles_, row_bytes_;
  const int32_t* table_;
  int64_t lo_ = 0, hi_ = 0;  // the item's keys
  // per tile: the union of its vectors' visible keys, and the intersection's bounds
  int64_t tile_lo_[kTilesPerItem], tile_hi_[kTilesPerItem], max_lo_[kTilesPerItem], min_hi_[kTilesPerItem];
};

void run_item(const AttnArgs& a, const Item& it) {
  static thread_local Scratch scratch;
  ItemRunner r(a, it, scratch);
  switch (a.cache_dtype) {
    case DType::F32: r.run<DType::F32>(); break;
    case DType::BF16: r.run<DType::BF16>(); break;
    default: r.run<DType::F16>(); break;
  }
}

}  // namespace

bool supported() { return cpu_has_avx512(); }

void prompt_attention(const AttnArgs& a) {
  const int64_t G = a.num_heads / a.num_kv_heads;
  std::vector<Item> items;
  int64_t work = 0;
  for (int64_t s = 0; s < a.num_seqs; ++s) {
    const int64_t qlen = a.query_start_loc[s + 1] - a.query_start_loc[s], vectors = qlen * G;
    for (int64_t h = 0; h < a.num_kv_heads; ++h)
      for (int64_t v0 = 0; v0 < vectors; v0 += kTilesPerItem * kTile)
        items.push_back({s, h, v0, std::min<int64_t>(kTilesPerItem * kTile, vectors - v0)});
    work += vectors * a.seq_lens[s];
  }
  // The last items of a sequence see the most keys: dynamic, one at a time.
  parallel_for(int64_t(items.size()), work >= kMinParallelWork, Schedule::Dynamic, 1,
               [&](int64_t i) { run_item(a, items[size_t(i)]); });
}

}  // namespace paged::cpu::attn::isa_avx512_lanes

#pragma GCC pop_options

#endif  // PAGED_ISA_X86 (the build compiles this file for x86 only)

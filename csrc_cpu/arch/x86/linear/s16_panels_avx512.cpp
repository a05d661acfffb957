// Persistent weight panels of the s16 layout's packed codes (s16.h,
// weight_panels.h) for the AVX-512 VNNI build, and the few-rows kernel that
// reads them; bitwise the scalar definition (kernel_s16_scalar.cpp).
//
// Few rows (decode) on packed codes read in place (s16_ymm.inc) spend ~10
// instructions a 32-block per weight row: unpacking, one dot product per
// row, then a horizontal reduction to the two half sums. Here the lanes of a
// zmm are 16 weight rows (as the int8 path's panels): a step of 4 codes is
// one vpdpbusd for 16 outputs and an x row, a half is 4 steps, and the half
// sums need no reduction: ~0.2 instructions a weight at one x row.
//
// A chunk of 32 weight rows is two columns of 16, each column one stream:
//   codes: per 32-block b, B = s16_base_bits(bits) base dwords of each row
//     (step f = 4h + s's codes u = q + bias, elements 4f .. 4f+3, their low
//     B bits at bit B (f / B) of dword f % B: for B = 4, dword s holds step
//     s of the first half in its low nibbles, of the second in its high),
//     then H = bits - B dwords of their high bits (step f's H bits of
//     element j at bit H*f % 8 of byte j of dword H*f / 8), each dword
//     index one zmm of the 16 rows: bits * 64 bytes a block, the packed
//     codes' size;
//   scales: d, then m where the weight has offsets, per half g the 16 rows'
//     values in the panels' form (PanelScales): float32 or fp16 [nh][16],
//     or compact bytes [nh][16] (CompactPairs: [nh / 2][16]) then supers
//     [nh / 16][16] (a float per 256 weights), widened in registers to the
//     weight's float32 bit for bit.
// So the panel holds as many bytes as the packed weight (fewer with
// CompactPairs) and every bit of it (s16_unpack_panel_chunk is the
// inverse): it replaces the packed arrays. Calls of more than
// s16_panel_rows() rows take the tiles on panels made from it in registers
// (kernel_s16_avx512.cpp, persistent_panel).
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>
#include <vector>

#include "arch/target.h"
#include "arch/x86/linear/s16_panel_avx512.h"
#include "attention/kernel_common.h"
#include "linear/compact_scales.h"
#include "linear/s16.h"

// GCC 12 reports its own AVX-512 intrinsic headers (the deliberately undefined
// pass-through operand __Y) as (maybe-)uninitialized: GCC bug 105593.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace paged::cpu::linear::isa_avx512 {
namespace {

// Half g's value of lane i (scales[o]), as the float32 the weight holds.
float scale_at(const S16Column& col, int o, int64_t g, int i) {
  const uint8_t* s = col.scales[o];
  switch (col.form) {
    case PanelScales::F16: {
      uint16_t h;
      std::memcpy(&h, s + 2 * (g * kLanes + i), 2);
      return attn::f16_to_float(h);
    }
    case PanelScales::Compact:
    case PanelScales::CompactPairs:
    case PanelScales::CompactF16:
    case PanelScales::CompactPairsF16: {
      const int64_t w = super_bytes(col.form);
      const float super = panel_super(s + supers_at(col.form, col.nh) + w * ((g / kHalvesPerSuper) * kLanes + i), col.form);
      return super * float(int8_t(s[g / halves_per_byte(col.form) * kLanes + i]));
    }
    case PanelScales::F32: break;
  }
  float v;
  std::memcpy(&v, s + 4 * (g * kLanes + i), 4);
  return v;
}

// A row's block (32 codes q) into lane i of its column's block (block_bytes
// from `block`), and back. Step f = 4h + s (elements 4f .. 4f + 3, one byte
// each) goes into base dword f % B at bit B (f / B) (for B = 4: dword s
// holds the first half's step s in its low nibbles, the second half's in its
// high ones) and its high bits into high dword H f / 8 at bit H f % 8.
constexpr uint32_t byte_mask(int bits) { return 0x01010101u * ((1u << bits) - 1); }

void encode_block(const int8_t* q, int bias, int bits, int i, uint8_t* block) {
  const int B = s16_base_bits(bits), H = bits - B;
  uint32_t base[4] = {}, high[2] = {};
  for (int f = 0; f < 8; ++f) {
    uint32_t field = 0;
    for (int j = 0; j < 4; ++j) field |= uint32_t(uint8_t(q[4 * f + j] + bias)) << (8 * j);
    base[f % B] |= (field & byte_mask(B)) << (B * (f / B));
    if (H) high[H * f / 8] |= ((field >> B) & byte_mask(H)) << (H * f % 8);
  }
  for (int v = 0; v < B; ++v) std::memcpy(block + v * 64 + 4 * i, &base[v], 4);
  for (int h = 0; h < H; ++h) std::memcpy(block + (B + h) * 64 + 4 * i, &high[h], 4);
}

void decode_block(const uint8_t* block, int bias, int bits, int i, int8_t* q) {
  const int B = s16_base_bits(bits), H = bits - B;
  for (int f = 0; f < 8; ++f) {
    uint32_t base, high = 0;
    std::memcpy(&base, block + (f % B) * 64 + 4 * i, 4);
    if (H) std::memcpy(&high, block + (B + H * f / 8) * 64 + 4 * i, 4);
    const uint32_t u = ((base >> (B * (f / B))) & byte_mask(B)) | ((high >> (H * f % 8)) & byte_mask(H)) << B;
    for (int j = 0; j < 4; ++j) q[4 * f + j] = int8_t(int((u >> (8 * j)) & 0xFF) - bias);
  }
}

// Lane `lane`'s codes q [K] in a column of a chunk.
void column_codes_of(const LinearArgs& a, const uint8_t* column_codes, int lane, int8_t* q) {
  const S16Shape sh(a, PanelScales::F32);  // the codes' place does not depend on the scales' form
  for (int64_t b = 0; b < sh.nb; ++b)
    decode_block(column_codes + b * sh.block_bytes(), a.code_bias, sh.bits, lane, q + b * kBlock);
}

}  // namespace

int64_t s16_panel_chunk_bytes(const LinearArgs& a, PanelScales form) {
  return kCols * S16Shape(a, form).column_bytes();
}

// Once per matrix, row by row (a load step).
void s16_build_panel_chunk(const LinearArgs& a, int64_t n0, int64_t n1, uint8_t* dst) {
  const S16Shape sh(a, a.panel_scales);
  std::memset(dst, 0, size_t(s16_panel_chunk_bytes(a, a.panel_scales)));
  std::vector<int8_t> q(size_t(a.K));
  const int64_t scale_row = a.d8 ? compact_row_bytes(sh.nh, a.K) : 0;
  for (int64_t n = n0; n < n1; ++n) {
    const int c = int((n - n0) / kLanes), i = int((n - n0) % kLanes);
    uint8_t* col = dst + c * sh.column_bytes();
    isa_avx2::s16_unpack(a.qs + n * a.row_bytes(), a.K, a.code_bits, a.code_bias, 1, q.data());
    for (int64_t b = 0; b < sh.nb; ++b) encode_block(q.data() + b * kBlock, a.code_bias, sh.bits, i, col + b * sh.block_bytes());
    for (int o = 0; o < (sh.offsets ? 2 : 1); ++o) {
      uint8_t* s = col + sh.nb * sh.block_bytes() + o * sh.scale_bytes();
      if (a.d8) {  // a compact form (every half's byte its pair's in the pairs forms: one kept)
        const uint8_t* row = (o ? a.m8 : a.d8) + n * scale_row;
        const int64_t per = halves_per_byte(sh.form), w = super_bytes(sh.form);
        for (int64_t g = 0; g < sh.nh; g += per) s[g / per * kLanes + i] = row[g];
        for (int64_t g = 0; g < sh.nh / kHalvesPerSuper; ++g) {
          float super;
          std::memcpy(&super, row + sh.nh + 4 * g, 4);
          store_panel_super(s + supers_at(sh.form, sh.nh) + w * (g * kLanes + i), sh.form, super);
        }
        continue;
      }
      const float* row = (o ? a.m : a.d) + n * sh.nh;
      for (int64_t g = 0; g < sh.nh; ++g) {
        if (sh.form == PanelScales::F16) {
          const uint16_t h = attn::float_to_f16(row[g]);  // exact: the caller checked they are fp16 values
          std::memcpy(s + 2 * (g * kLanes + i), &h, 2);
        } else {
          std::memcpy(s + 4 * (g * kLanes + i), row + g, 4);
        }
      }
    }
  }
}

void s16_unpack_panel_chunk(const LinearArgs& a, int64_t n0, int64_t n1, const uint8_t* src) {
  const S16Shape sh(a, a.panel_scales);
  std::vector<int8_t> q(size_t(a.K));
  const int64_t scale_row = a.d8 ? compact_row_bytes(sh.nh, a.K) : 0;
  for (int64_t n = n0; n < n1; ++n) {
    const int c = int((n - n0) / kLanes), i = int((n - n0) % kLanes);
    const S16Column col = sh.column(src, c);
    column_codes_of(a, col.codes, i, q.data());
    pack_s16_row(q.data(), a.K, a.code_bits, a.code_bias, const_cast<uint8_t*>(a.qs) + n * a.row_bytes());
    for (int o = 0; o < (sh.offsets ? 2 : 1); ++o) {
      if (a.d8) {
        uint8_t* row = const_cast<uint8_t*>(o ? a.m8 : a.d8) + n * scale_row;
        const uint8_t* s = col.scales[o];
        for (int64_t g = 0; g < sh.nh; ++g) row[g] = s[g / halves_per_byte(sh.form) * kLanes + i];
        for (int64_t g = 0; g < sh.nh / kHalvesPerSuper; ++g) {
          const int64_t w = super_bytes(sh.form);
          const float super = panel_super(s + supers_at(sh.form, sh.nh) + w * (g * kLanes + i), sh.form);
          std::memcpy(row + sh.nh + 4 * g, &super, 4);
        }
        continue;
      }
      float* row = const_cast<float*>(o ? a.m : a.d) + n * sh.nh;
      for (int64_t g = 0; g < sh.nh; ++g) row[g] = scale_at(col, o, g, i);
    }
  }
}

PAGED_TARGET_BEGIN("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
namespace {

template <class F, int... I>
PAGED_ALWAYS_INLINE void each_step(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}

// Column c of a chunk for x rows r0 .. r0 + R (R <= 4 with int8x2's two
// terms, <= 8 with one): per block and half, the 4 steps' exact sums of
// the 16 rows (vpdpbusd on u, less half_bias = bias * the half's sum of x's
// codes where the codes carry a bias), then the half's chain step (the
// offsets: few_rows adds them once every pass is done). The column streams in
// order; while block b is read, its share of the same column `ahead` bytes
// on is prefetched into L2 (the thread's item after next).
template <int Bits, int R, bool Two>
void panel_column(const S16Args& s, const S16Column& col, int64_t column_bytes, int64_t ahead, int64_t r0,
                  int64_t n0, __mmask16 mask) {
  const LinearArgs& a = *s.a;
  const int64_t K = a.K, nb = K / kBlock, nh = K / kS16Half;
  constexpr int B = s16_base_bits(Bits), H = Bits - B;
  constexpr int64_t block_bytes = Bits * 64;
  const int64_t share = column_bytes / nb;
  const bool pairs = pairs_form(col.form);
  __m512 e[R][2];
  for (int r = 0; r < R; ++r) e[r][0] = e[r][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* w = col.codes + b * block_bytes;
    for (int64_t at = b * share; at < (b + 1) * share; at += 64)
      _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(col.codes) + uintptr_t(at + ahead)),
                   _MM_HINT_T1);
    __m512i base[B], high[H > 0 ? H : 1];
    for (int i = 0; i < B; ++i) base[i] = _mm512_load_si512(w + i * 64);
    for (int i = 0; i < H; ++i) high[i] = _mm512_load_si512(w + (B + i) * 64);
    __m512 d, scale[R];  // the half's scales; their products with dx (compact pairs: both halves')
    const auto half = [&](auto hc) PAGED_ALWAYS_INLINE_LAMBDA {
      constexpr int h = decltype(hc)::value;
      __m512i hi[R], lo[Two ? R : 1];
      for (int r = 0; r < R; ++r) {
        hi[r] = _mm512_setzero_si512();
        if constexpr (Two) lo[r] = _mm512_setzero_si512();
      }
      each_step(
          [&](auto sc) PAGED_ALWAYS_INLINE_LAMBDA {
            constexpr int st = decltype(sc)::value;
            const __m512i u = step_codes<Bits, h, st>(base, high);
            for (int r = 0; r < R; ++r) {
              const int64_t at = (r0 + r) * K + b * kBlock + 16 * h + 4 * st;
              hi[r] = _mm512_dpbusd_epi32(hi[r], u, broadcast4(a.x8 + at));
              if constexpr (Two) lo[r] = _mm512_dpbusd_epi32(lo[r], u, broadcast4(a.x8_lo + at));
            }
          },
          std::make_integer_sequence<int, 4>());
      const int64_t g = 2 * b + h;
      // compact pairs (Q5_K): the second half's scales are the first's, widened and multiplied once
      const bool fresh = h == 0 || !pairs;
      if (fresh) d = lane_scales(col, 0, g);
      for (int r = 0; r < R; ++r) {
        __m512i isum = hi[r];
        if constexpr (Two) isum = _mm512_add_epi32(_mm512_slli_epi32(hi[r], 8), lo[r]);
        if (s.half_bias) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(s.half_bias[(r0 + r) * nh + g]));
        if (fresh) scale[r] = _mm512_mul_ps(d, _mm512_set1_ps(a.x8_scale[(r0 + r) * nb + b]));
        e[r][h] = _mm512_fmadd_ps(scale[r], _mm512_cvtepi32_ps(isum), e[r][h]);
      }
    };
    half(std::integral_constant<int, 0>{});
    half(std::integral_constant<int, 1>{});
  }
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(a.out + (r0 + r) * a.N + n0, mask, _mm512_add_ps(e[r][0], e[r][1]));
}

using ColumnFn = void (*)(const S16Args&, const S16Column&, int64_t column_bytes, int64_t ahead, int64_t r0,
                          int64_t n0, __mmask16 mask);

template <int Bits, bool Two, int... R>
constexpr std::array<ColumnFn, sizeof...(R)> column_table(std::integer_sequence<int, R...>) {
  return {&panel_column<Bits, R + 1, Two>...};
}

// x rows per pass over a column: all of int8's (up to kS16FewRows), int8x2's in passes of up to 4
// (its two sums a row and the chains fill the registers); a second pass reads the column from L2.
// (Zen 4, 1B shapes, 3-8 rows: passes of 2, or 4 one-term rows, were 0.7-1.0x these.)
constexpr int kTwoTermRows = 4;

template <int Bits>
void few_rows(const S16Args& s, const S16Shape& sh, const uint8_t* chunk, int64_t chunk_bytes, int64_t n0,
              int64_t n1) {
  static constexpr auto one = column_table<Bits, false>(std::make_integer_sequence<int, int(kS16FewRows)>());
  static constexpr auto two = column_table<Bits, true>(std::make_integer_sequence<int, kTwoTermRows>());
  const LinearArgs& a = *s.a;
  const bool two_terms = a.x8_lo != nullptr;
  const int64_t pass = two_terms ? kTwoTermRows : kS16FewRows;
  const int64_t passes = (a.M + pass - 1) / pass;
  for (int c = 0; c < kCols; ++c) {
    const int rows = int(std::clamp<int64_t>(n1 - n0 - c * kLanes, 0, kLanes));
    if (!rows) break;
    const S16Column col = sh.column(chunk, c);
    const auto mask = __mmask16((1u << rows) - 1);
    for (int64_t p = 0, r0 = 0; p < passes; ++p) {  // rows in passes of as even a size as allowed
      const int64_t count = a.M / passes + (p < a.M % passes);
      (two_terms ? two.data() : one.data())[size_t(count - 1)](s, col, sh.column_bytes(), 2 * chunk_bytes, r0,
                                                                n0 + c * kLanes, mask);
      r0 += count;
    }
    if (sh.offsets)  // every row's offsets added once the passes are done (column_offsets)
      column_offsets(col, s.xs, a.M, {a.out + n0 + c * kLanes, a.N, mask, true});
  }
}

}  // namespace

void s16_panel_few_rows(const S16Args& s, int64_t n0, int64_t n1) {
  const LinearArgs& a = *s.a;
  const S16Shape sh(a, a.panel_scales);
  const int64_t chunk_bytes = s16_panel_chunk_bytes(a, a.panel_scales);
  for (int64_t n = n0; n < n1; n += kPanel) {
    const uint8_t* chunk = a.panels + (n / kPanel) * chunk_bytes;
    const int64_t end = std::min(n1, n + kPanel);
    switch (sh.bits) {
      case 2: few_rows<2>(s, sh, chunk, chunk_bytes, n, end); break;
      case 3: few_rows<3>(s, sh, chunk, chunk_bytes, n, end); break;
      case 4: few_rows<4>(s, sh, chunk, chunk_bytes, n, end); break;
      case 5: few_rows<5>(s, sh, chunk, chunk_bytes, n, end); break;
      default: few_rows<6>(s, sh, chunk, chunk_bytes, n, end); break;
    }
  }
}

PAGED_TARGET_END()

}  // namespace paged::cpu::linear::isa_avx512

#pragma GCC diagnostic pop

// q8_0 codes packed into 5 bits (qtype "q8_0.s5"): the q8_0 layout
// (w = d[n, k/32] * q) for matrices whose codes all lie in -16..15, which is
// what GGUF's Q5_0 unpacks into (codes q - 16). llama.cpp writes Q5_0 for the
// rows of a Q4_K_M file whose length is not a multiple of 256 (Gemma 3 1B's
// 1152, Qwen2.5-0.5B's 896, SmolLM2's 576 and 960), so a byte per code read
// 1.6x the file's bits there; packed, a block is 20 bytes against the byte
// form's 32.
//
// Per 32-block of a row, 20 bytes: 16 bytes of nibbles (byte l: element l's
// low 4 bits in bits 0-3, element 16 + l's in bits 4-7), then 4 bytes of
// fifth bits (element e's in byte 16 + e % 4, bit e / 4), of u = q + 16. The
// fifth bits' order is the kernels': a block's elements 4t .. 4t + 3 are the
// bytes of one dword of codes (step t), and their fifth bits are bit t of
// the fifth-bit dword's bytes, so one shift and one mask put them at bit 4
// of each byte.
//
// A build whose table says q8_reads_packed (every x86 build past scalar)
// reads them in place: calls of few rows widen each block's 4 nibble dwords
// and its fifth-bit dword in registers, larger calls build their per-call
// panels from them (avx512's persistent panels hold the dwords transposed).
// For the other builds (scalar, NEON) the drivers unpack each work item's
// rows into the calling thread's int8 scratch just before the q8_0 kernel
// runs (quant_linear.cpp: ~10 instructions per 32 codes, which cost a 0.5B
// Q4_K_M decode 0.7x of its byte form's speed on Zen 4). Either way every
// build computes the byte form's bits, and the weight streams packed.
//
// q8_0 codes as indices into IQ4_NL's table (qtype "q8_0.nl4"): GGUF's
// IQ4_NL unpacks into q8_0 codes that are its table's 16 values (-127 ..
// 113, not an affine grid), so a matrix whose codes all lie in the table
// keeps each code's 4-bit index, 16 bytes per 32-block laid out as the
// nibbles above (GGUF's own IQ4_NL bytes): 0.5 bytes a code against 1.
// Every x86 build past scalar reads them in place (Kernels::q8_reads_table):
// each step's nibbles looked up (`vpshufb`, the table in every 128-bit lane)
// as the q8 codes (or q + 128) its q8_0 kernels multiply; avx512's
// persistent panels keep the transposed nibble dwords as the 4-bit types'
// do. Scalar and NEON unpack each work item's rows into the thread's
// scratch (Kernels::table4_unpack, the definition unpack_table4_rows).
// Every build computes the byte form's bits.
#pragma once

#include <cstdint>

#include "linear/aligned.h"
#include "linear/quant_linear.h"

namespace paged::cpu::linear {

constexpr int kQ8PackedBits = 5;
constexpr int kQ8PackedBias = 16;  // u = q + 16

inline bool q8_packed(const LinearArgs& a) { return a.qtype == QType::Q8_0 && a.code_bits == kQ8PackedBits; }

constexpr int kQ8TableBits = 4;
// IQ4_NL's code values, by index (its format's table)
constexpr int8_t kIq4nlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
inline bool q8_table(const LinearArgs& a) { return a.qtype == QType::Q8_0 && a.code_bits == kQ8TableBits; }

// Rows [0, rows) of table-index rows (K / 32 * 16 bytes each) into int8
// [rows, K] (the definition; Kernels::table4_unpack gives the same bytes).
inline void unpack_table4_rows(const uint8_t* packed, int64_t K, int64_t rows, int8_t* out) {
  for (int64_t i = 0; i < rows * (K / kBlock); ++i)
    for (int l = 0; l < kBlock / 2; ++l) {
      const uint8_t byte = packed[i * (kBlock / 2) + l];
      out[i * kBlock + l] = kIq4nlValues[byte & 15];
      out[i * kBlock + 16 + l] = kIq4nlValues[byte >> 4];
    }
}

// The table's index of code q, or -1 where q is not one of its values.
inline int table4_index(int q) {
  for (int i = 0; i < 16; ++i)
    if (kIq4nlValues[i] == q) return i;
  return -1;
}

// One row's codes [K] (each a table value) as indices into out (K / 32 * 16
// bytes); false (out unspecified) at a code the table lacks.
inline bool pack_table4_row(const int8_t* codes, int64_t K, uint8_t* out) {
  for (int64_t b = 0; b < K / kBlock; ++b)
    for (int l = 0; l < kBlock / 2; ++l) {
      const int lo = table4_index(codes[b * kBlock + l]), hi = table4_index(codes[b * kBlock + 16 + l]);
      if (lo < 0 || hi < 0) return false;
      out[b * (kBlock / 2) + l] = uint8_t(lo | hi << 4);
    }
  return true;
}

// Rows [0, rows) of packed rows (K / 32 * 20 bytes each) into int8 [rows, K]
// (the definition; Kernels::block5_unpack gives the same bytes).
inline void unpack_block5_rows(const uint8_t* packed, int64_t K, int bias, int64_t rows, int8_t* out) {
  const int64_t nb = K / kBlock;
  for (int64_t i = 0; i < rows * nb; ++i) {
    const uint8_t* src = packed + i * kQ8PackedBlockBytes;
    int8_t* dst = out + i * kBlock;
    for (int e = 0; e < kBlock; ++e) {
      const int nibble = (src[e & 15] >> (e < 16 ? 0 : 4)) & 15, fifth = (src[16 + e % 4] >> (e / 4)) & 1;
      dst[e] = int8_t((nibble | fifth << 4) - bias);
    }
  }
}

// One row's codes [K] (each in -16..15) packed as above into out (K / 32 * 20 bytes).
inline void pack_block5_row(const int8_t* codes, int64_t K, int bias, uint8_t* out) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    uint8_t* dst = out + b * kQ8PackedBlockBytes;
    for (int i = 0; i < kQ8PackedBlockBytes; ++i) dst[i] = 0;
    for (int e = 0; e < kBlock; ++e) {
      const int u = codes[b * kBlock + e] + bias;
      dst[e & 15] |= uint8_t((u & 15) << (e < 16 ? 0 : 4));
      dst[16 + e % 4] |= uint8_t((u >> 4) << (e / 4));
    }
  }
}

// A work item's codes, unpacked just before its kernel runs: rows [n0, n1)
// into the calling thread's buffer (a work item's rows: 18-156 KiB at 0.5-8B
// shapes, so they stay in L1/L2 for the kernel), a.qs rebased so that row n
// is at qs + n * K as for the byte form (only rows [n0, n1) are read through
// it; prefetches past them compute their addresses as integers, as
// compact_scales.h's ItemWidener does for scales). a itself unless packed.
struct ItemCodes {
  Block5Unpack fn = unpack_block5_rows;  // the build's (Kernels::block5_unpack), same bytes
  Table4Unpack table = unpack_table4_rows;  // the build's (Kernels::table4_unpack), same bytes
  LinearArgs item(LinearArgs a, int64_t n0, int64_t n1) const {
    if (!q8_packed(a) && !q8_table(a)) return a;
    static thread_local AlignedVector<int8_t> buf;
    const auto count = size_t((n1 - n0) * a.K);
    if (buf.size() < count) buf.resize(count);
    if (q8_table(a)) table(a.qs + n0 * a.row_bytes(), a.K, n1 - n0, buf.data());
    else fn(a.qs + n0 * a.row_bytes(), a.K, kQ8PackedBias, n1 - n0, buf.data());
    a.qs = reinterpret_cast<const uint8_t*>(reinterpret_cast<uintptr_t>(buf.data()) - uintptr_t(n0 * a.K));
    a.code_bits = 8;
    return a;
  }
};
inline ItemCodes item_codes(const Kernels& k) {
  return {k.block5_unpack ? k.block5_unpack : unpack_block5_rows, k.table4_unpack ? k.table4_unpack : unpack_table4_rows};
}

namespace isa_avx2 {  // arch/x86/linear/block5_unpack_avx2.cpp
void block5_unpack(const uint8_t* packed, int64_t K, int bias, int64_t rows, int8_t* out);
void table4_unpack(const uint8_t* packed, int64_t K, int64_t rows, int8_t* out);
}

}  // namespace paged::cpu::linear

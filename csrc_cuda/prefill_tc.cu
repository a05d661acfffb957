// Prefill attention on tensor cores (float16 / bfloat16), FlashAttention-2
// style: a CTA owns a tile of 64 query rows of one (sequence, kv head) and
// walks the visible keys in tiles of kKeys, reading K/V through the block
// table; scores and the output accumulate in float32, the softmax is online
// (running max and sum per row), so nothing of size rows x keys is stored.
//
// Rows are (query position, query head of the kv head's group) pairs, as in
// attention.cu, so all query heads of a GQA group share each K/V tile. Each
// of the 4 warps owns 16 rows:
//   S = Q K^T   wmma 16x16x16 (mma.sync), float32 accumulators -> shared memory
//   softmax     two lanes per row (half the tile's keys each): mask (causal,
//               sliding window, the sequence's end), running max, P in T
//   O += P V    wmma; the 16x16 product tiles go through a per-warp scratch
//               so that each lane rescales and adds its own row's half
// A warp skips a key tile no row of it can see (causal), so a prefill does
// about half the products of the full square.
//
// Shared memory (dynamic; 81 KiB at head size 128, 84 KiB at 256):
//   Q [64][D+8] T, K and V [kKeys][D+8] T (the +8 pads rows apart in banks,
//   keeping the 32-byte alignment wmma needs), per warp S [16][kKeys+4] f32,
//   P [16][kKeys+8] T and a 16x16 f32 scratch.
// kKeys is 64, 32 at head size 256 (which keeps K/V at 32 KiB).
// Instantiated for kHeadSizes x {float16, bfloat16} only (compile time).
#include <mma.h>

#include <cmath>

#include "common.cuh"

namespace paged::cuda {
namespace {

namespace wmma = nvcuda::wmma;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRows = kWarps * 16;  // query rows per CTA
constexpr int kPad = 8;             // elements of padding per T row

template <int D>
struct Tile {
  static constexpr int kKeys = D > 128 ? 32 : 64;
  static constexpr int kLd = D + kPad;          // Q, K, V rows (T)
  static constexpr int kLdS = kKeys + 4;        // scores (float)
  static constexpr int kLdP = kKeys + kPad;     // probabilities (T)
  static constexpr int kVecs = D / 8;           // 16-byte vectors per T row
  template <typename T>
  static constexpr std::size_t bytes() {
    return sizeof(T) * (std::size_t(kRows) * kLd + 2 * std::size_t(kKeys) * kLd) +
           kWarps * (sizeof(float) * 16 * kLdS + sizeof(T) * 16 * kLdP + sizeof(float) * 16 * 16);
  }
};

using Acc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// acc = A B for one warp: A 16 x (16 kSteps) row-major at `a` (ld lda), B
// (16 kSteps) x 16 in layout BLayout at `b` (ld ldb), its k-th 16-slice at
// b + k * b_step (16 for K^T read col-major from K rows, 16 rows for V).
template <typename T, typename BLayout, int kSteps>
__device__ __forceinline__ void warp_mma(Acc& acc, const T* a, int lda, const T* b, int ldb, int b_step) {
  wmma::fill_fragment(acc, 0.f);
#pragma unroll
  for (int k = 0; k < kSteps; ++k) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, BLayout> fb;
    wmma::load_matrix_sync(fa, a + k * 16, lda);
    wmma::load_matrix_sync(fb, b + k * b_step, ldb);
    wmma::mma_sync(acc, fa, fb, acc);
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
    prefill_tc_kernel(AttentionArgs a, int num_kv_heads, int block_size, int num_blocks) {
  using TL = Tile<D>;
  constexpr int kKeys = TL::kKeys, kLd = TL::kLd, kLdS = TL::kLdS, kLdP = TL::kLdP, kVecs = TL::kVecs;
  extern __shared__ __align__(128) unsigned char smem[];
  T* s_q = reinterpret_cast<T*>(smem);
  T* s_k = s_q + kRows * kLd;
  T* s_v = s_k + kKeys * kLd;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  unsigned char* wbase = reinterpret_cast<unsigned char*>(s_v + kKeys * kLd) +
                         warp * (sizeof(float) * 16 * kLdS + sizeof(T) * 16 * kLdP + sizeof(float) * 16 * 16);
  float* s_s = reinterpret_cast<float*>(wbase);
  T* s_p = reinterpret_cast<T*>(s_s + 16 * kLdS);
  float* s_o = reinterpret_cast<float*>(s_p + 16 * kLdP);

  const int kvh = blockIdx.x, seq = blockIdx.y;
  const int group = a.num_heads / num_kv_heads;
  const int seq_len = a.seq_lens[seq];
  const int q_begin = a.query_start_loc[seq];
  const int q_len = a.query_start_loc[seq + 1] - q_begin;
  if (q_begin < 0 || q_len < 1 || q_len > seq_len || q_begin + q_len > a.num_query_rows) return;  // guard
  const int num_rows = q_len * group;
  const int row0 = blockIdx.z * kRows;
  if (row0 >= num_rows) return;
  const int last_row = min(row0 + kRows, num_rows) - 1;
  const int pos0 = seq_len - q_len;  // position of query row 0
  const int window = a.sliding_window;
  const int key_begin = first_visible_key(pos0 + row0 / group, window);
  const int key_end = pos0 + last_row / group + 1;

  // Q tile, 16 bytes at a time; rows past the sequence's are zeros.
  const uint4* query = static_cast<const uint4*>(a.query);
  for (int i = threadIdx.x; i < kRows * kVecs; i += kThreads) {
    const int r = i / kVecs, c = i % kVecs, row = row0 + r;
    uint4 x = make_uint4(0, 0, 0, 0);
    if (row <= last_row) {
      const int head = kvh * group + row % group;
      x = query[(std::int64_t(q_begin + row / group) * a.num_heads + head) * kVecs + c];
    }
    *reinterpret_cast<uint4*>(s_q + r * kLd + c * 8) = x;
  }

  // This lane's row (two lanes per row, each half the keys / output dims).
  const int rr = lane / 2, half = lane % 2;
  const int my_row = row0 + warp * 16 + rr;
  const bool row_ok = my_row <= last_row;
  const int my_pos = pos0 + my_row / group;
  const int warp_last = min(row0 + warp * 16 + 15, last_row);
  const int warp_max_pos = pos0 + warp_last / group;  // keys beyond it are invisible to the whole warp
  const int warp_min_pos = pos0 + (row0 + warp * 16) / group;
  float m = -INFINITY, l = 0.f;
  float o[D / 2];  // this lane's half of its row: for each 16-dim tile j, dims j*16 + half*8 + [0, 8)
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;

  const int* table = a.block_tables + std::int64_t(seq) * a.max_blocks_per_seq;
  for (int tile = key_begin; tile < key_end; tile += kKeys) {
    __syncthreads();  // the previous tile is consumed (and Q is written)
    for (int i = threadIdx.x; i < kKeys * kVecs; i += kThreads) {
      const int j = i / kVecs, c = i % kVecs;
      const KvVectors kv = load_kv_vectors(a, table, kvh, tile + j, key_end, c, kVecs, num_kv_heads, block_size,
                                           num_blocks);
      *reinterpret_cast<uint4*>(s_k + j * kLd + c * 8) = kv.k;
      *reinterpret_cast<uint4*>(s_v + j * kLd + c * 8) = kv.v;
    }
    __syncthreads();
    // warp-uniform skips: the whole tile is after every row's position, or
    // (sliding window) before every row's first visible key
    if (row0 + warp * 16 > last_row || tile > warp_max_pos) continue;
    if (window > 0 && tile + kKeys - 1 <= warp_min_pos - window) continue;

    // S = Q K^T for the warp's 16 rows
#pragma unroll
    for (int n = 0; n < kKeys / 16; ++n) {  // K rows, row-major, are K^T col-major
      Acc s_acc;
      warp_mma<T, wmma::col_major, D / 16>(s_acc, s_q + (warp * 16) * kLd, kLd, s_k + (n * 16) * kLd, kLd, 16);
      wmma::store_matrix_sync(s_s + n * 16, s_acc, kLdS, wmma::mem_row_major);
    }
    __syncwarp();

    // online softmax over this lane's half of the row's keys
    constexpr int kHalf = kKeys / 2;
    float tile_max = -INFINITY;
#pragma unroll 8
    for (int c = 0; c < kHalf; ++c) {
      const int col = half * kHalf + c, key = tile + col;
      const bool visible = row_ok && key < key_end && key <= my_pos && (window <= 0 || key > my_pos - window);
      const float x = visible ? s_s[rr * kLdS + col] * a.scale : -INFINITY;
      s_s[rr * kLdS + col] = x;
      tile_max = fmaxf(tile_max, x);
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    const float m_new = fmaxf(m, tile_max);
    float alpha = 1.f, sum = 0.f;
    if (m_new == -INFINITY) {  // nothing visible to this row yet: P = 0, state unchanged
#pragma unroll 8
      for (int c = 0; c < kHalf; ++c) s_p[rr * kLdP + half * kHalf + c] = from_float<T>(0.f);
    } else {
      alpha = expf(m - m_new);  // 0 when m was -inf (o and l are 0 then)
#pragma unroll 8
      for (int c = 0; c < kHalf; ++c) {
        const int col = half * kHalf + c;
        const float p = expf(s_s[rr * kLdS + col] - m_new);
        sum += p;
        s_p[rr * kLdP + col] = from_float<T>(p);
      }
      m = m_new;
    }
    l = l * alpha + sum + __shfl_xor_sync(0xffffffffu, sum, 1);
    __syncwarp();

    // O = alpha O + P V, one 16-dim tile at a time through the scratch
#pragma unroll
    for (int j = 0; j < D / 16; ++j) {
      Acc o_acc;
      warp_mma<T, wmma::row_major, kKeys / 16>(o_acc, s_p, kLdP, s_v + j * 16, kLd, 16 * kLd);
      wmma::store_matrix_sync(s_o, o_acc, 16, wmma::mem_row_major);
      __syncwarp();
#pragma unroll
      for (int c = 0; c < 8; ++c) o[j * 8 + c] = o[j * 8 + c] * alpha + s_o[rr * 16 + half * 8 + c];
      __syncwarp();  // the scratch is read before the next tile's store
    }
  }

  if (!row_ok) return;
  const int head = kvh * group + my_row % group;
  const float inv = l > 0.f ? 1.f / l : 0.f;
  T* out = static_cast<T*>(a.out) + (std::int64_t(q_begin + my_row / group) * a.num_heads + head) * D;
#pragma unroll
  for (int j = 0; j < D / 16; ++j)
#pragma unroll
    for (int c = 0; c < 8; ++c) out[j * 16 + half * 8 + c] = from_float<T>(o[j * 8 + c] * inv);
}

template <typename T, int D>
void launch(const AttentionArgs& a, const CacheGeometry& g, cudaStream_t stream) {
  const int group = a.num_heads / g.num_kv_heads;
  const long long row_tiles = (static_cast<long long>(a.max_query_len) * group + kRows - 1) / kRows;
  if (a.num_seqs > 65535 || row_tiles > 65535 || row_tiles < 1)
    throw std::invalid_argument("prefill_attention: launch too large (" + std::to_string(a.num_seqs) +
                                " sequences, " + std::to_string(row_tiles) + " row tiles; each must be <= 65535)");
  constexpr std::size_t bytes = Tile<D>::template bytes<T>();
  allow_shared_memory(prefill_tc_kernel<T, D>, bytes, "prefill_attention");
  const dim3 grid(g.num_kv_heads, a.num_seqs, static_cast<unsigned>(row_tiles));
  prefill_tc_kernel<T, D><<<grid, kThreads, bytes, stream>>>(a, g.num_kv_heads, g.block_size, g.num_blocks);
  check_launch("prefill_attention");
}

}  // namespace

void prefill_tensor_core(const AttentionArgs& a, const CacheGeometry& g, cudaStream_t stream) {
  dispatch_head_size(g.head_size, [&](auto d) {
    constexpr int D = decltype(d)::value;
    if (g.dtype == DType::BF16)
      launch<__nv_bfloat16, D>(a, g, stream);
    else if (g.dtype == DType::F16)
      launch<__half, D>(a, g, stream);
    else
      throw std::invalid_argument("prefill_attention (tensor cores): expected float16 or bfloat16");
  });
}

}  // namespace paged::cuda

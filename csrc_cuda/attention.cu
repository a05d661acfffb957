// Paged attention on CUDA cores: decode (every dtype), prefill in float32,
// and the split-K reduction used by long decodes. Prefill in float16 /
// bfloat16 runs on tensor cores instead (prefill_tc.cu).
//
// A CTA handles one (sequence, kv head, tile of 16 query rows). A "row" is a
// (query position, query head of this kv head's group) pair, so all query
// heads of a GQA group share every K/V tile the CTA loads; a decode is the
// case of one position and `group` rows. Keys stream through shared memory in
// tiles of 32 (one key per lane when scoring) with an online softmax; each
// warp owns 4 rows (assigned round-robin so small groups still spread over
// all warps) and each lane owns ceil(head_size/32) output dims of each row.
// Shared memory is sized at launch (81 KiB at head size 256, past the 48 KiB
// a static array may take).
//
// Split-K (decode only): a sequence's visible keys are cut into fixed
// partitions of kSplitPartition keys starting at its first visible key; the
// partition count depends on its length (and window) alone, so its result does
// not depend on what else is in the batch. With one partition the kernel
// writes the final output; otherwise partial (out, max, sum) go to the float32
// workspace and split_reduce_kernel combines them. The launch has
// `a.max_splits` partitions per sequence, sized by the caller from the step's
// longest decode (backends/cuda/launch.py); a sequence that would need more
// gets NaN outputs (a visible error), never a softmax over part of its keys.
//
// Grid: x = row tiles x partitions (up to 2^31 - 1, so a long context never
// hits the 65535 limit of y and z), y = sequence, z = kv head.
#include <cmath>

#include "common.cuh"

namespace paged::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kKeyTile = 32;
constexpr int kRowsPerWarp = 4;
constexpr int kRowsPerCta = kWarps * kRowsPerWarp;
constexpr unsigned kFullMask = 0xffffffffu;

__host__ __device__ inline int num_partitions(int num_keys) {
  return (num_keys + kSplitPartition - 1) / kSplitPartition;
}
// Partitions of a decode sequence of length seq_len (its query is at seq_len - 1).
__device__ inline int decode_partitions(int seq_len, int window) {
  return num_partitions(seq_len - first_visible_key(seq_len - 1, window));
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(kFullMask, x, o);
  return x;
}

template <int D>
constexpr std::size_t smem_bytes() {
  return sizeof(float) * (kRowsPerCta * D + kKeyTile * (D + 1) + kKeyTile * D);
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
    attention_kernel(AttentionArgs a, int num_kv_heads, int block_size, int num_blocks, int grid_splits) {
  constexpr int kVec = 16 / sizeof(T);  // elements per 16-byte load
  constexpr int kRowVecs = D / kVec;
  constexpr int kLaneDims = (D + 31) / 32;  // lane owns dims lane + 32 c, those < D
  extern __shared__ __align__(16) float smem[];
  auto s_q = reinterpret_cast<float (*)[D]>(smem);                                  // [kRowsPerCta][D]
  auto s_k = reinterpret_cast<float (*)[D + 1]>(smem + kRowsPerCta * D);  // +1: lane j reads row j, no conflicts
  auto s_v = reinterpret_cast<float (*)[D]>(smem + kRowsPerCta * D + kKeyTile * (D + 1));

  const int kvh = blockIdx.z, seq = blockIdx.y;
  const int row_tile = blockIdx.x / grid_splits, split = blockIdx.x % grid_splits;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const bool decode = a.query_start_loc == nullptr;
  const int group = a.num_heads / num_kv_heads;
  const int seq_len = a.seq_lens[seq];
  const int q_begin = decode ? seq : a.query_start_loc[seq];
  const int q_len = decode ? 1 : a.query_start_loc[seq + 1] - q_begin;
  if (q_begin < 0 || q_len < 1 || q_begin + q_len > a.num_query_rows) return;  // device-side guard
  const int num_rows = q_len * group;
  const int row0 = row_tile * kRowsPerCta;
  if (row0 >= num_rows) return;
  const int last_row = min(row0 + kRowsPerCta, num_rows) - 1;
  const int pos0 = seq_len - q_len;  // position of query row 0

  // Keys needed: the union of this tile's rows' visible ranges, or one partition of it.
  int key_begin = first_visible_key(pos0 + row0 / group, a.sliding_window);
  int key_end = pos0 + last_row / group + 1;
  // more partitions than launched: NaN rows (one CTA writes them), no partial softmax
  const bool too_long = decode && num_partitions(key_end - key_begin) > a.max_splits;
  const int splits = decode && !too_long ? num_partitions(key_end - key_begin) : 1;
  if (split >= splits) return;
  if (too_long) key_end = key_begin;
  if (splits > 1) {
    key_begin += split * kSplitPartition;
    key_end = min(key_end, key_begin + kSplitPartition);
  }

  const T* query = static_cast<const T*>(a.query);
  for (int i = threadIdx.x; i < kRowsPerCta * D; i += kThreads) {
    const int r = i / D, d = i % D, row = row0 + r;
    float x = 0.f;
    if (row < num_rows) {
      const int head = kvh * group + row % group;
      x = to_float(query[(std::int64_t(q_begin + row / group) * a.num_heads + head) * D + d]) * a.scale;
    }
    s_q[r][d] = x;
  }

  float m[kRowsPerWarp], l[kRowsPerWarp], acc[kRowsPerWarp][kLaneDims];
  int pos[kRowsPerWarp];
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    m[i] = -INFINITY;
    l[i] = 0.f;
    pos[i] = pos0 + (row0 + i * kWarps + warp) / group;
#pragma unroll
    for (int c = 0; c < kLaneDims; ++c) acc[i][c] = 0.f;
  }

  const int* table = a.block_tables + std::int64_t(seq) * a.max_blocks_per_seq;
  for (int tile = key_begin; tile < key_end; tile += kKeyTile) {
    __syncthreads();  // the previous tile is consumed (and s_q is written)
    for (int v = threadIdx.x; v < kKeyTile * kRowVecs; v += kThreads) {
      const int j = v / kRowVecs, c = v % kRowVecs;
      const KvVectors kv = load_kv_vectors(a, table, kvh, tile + j, key_end, c, kRowVecs, num_kv_heads,
                                           block_size, num_blocks);
      const T* ke = reinterpret_cast<const T*>(&kv.k);
      const T* ve = reinterpret_cast<const T*>(&kv.v);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        s_k[j][c * kVec + e] = to_float(ke[e]);
        s_v[j][c * kVec + e] = to_float(ve[e]);
      }
    }
    __syncthreads();

    const int key = tile + lane;
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int r = i * kWarps + warp;
      if (row0 + r > last_row) continue;  // warp-uniform
      float s = 0.f;
#pragma unroll 16
      for (int d = 0; d < D; ++d) s += s_q[r][d] * s_k[lane][d];
      const bool visible = key < key_end && key <= pos[i] &&
                           (a.sliding_window <= 0 || key > pos[i] - a.sliding_window);
      s = visible ? s : -INFINITY;
      const float m_new = fmaxf(m[i], warp_max(s));
      if (m_new == -INFINITY) continue;  // nothing visible to this row yet (warp-uniform)
      const float p = expf(s - m_new);
      const float alpha = expf(m[i] - m_new);
      l[i] = l[i] * alpha + warp_sum(p);
      m[i] = m_new;
#pragma unroll
      for (int c = 0; c < kLaneDims; ++c) acc[i][c] *= alpha;
#pragma unroll 8
      for (int j = 0; j < kKeyTile; ++j) {
        const float pj = __shfl_sync(kFullMask, p, j);
#pragma unroll
        for (int c = 0; c < kLaneDims; ++c)
          if (lane + 32 * c < D) acc[i][c] += pj * s_v[j][lane + 32 * c];
      }
    }
  }

#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int row = row0 + i * kWarps + warp;
    if (row > last_row) continue;
    const int head = kvh * group + row % group;
    const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
    if (splits == 1) {
      T* out = static_cast<T*>(a.out) + (std::int64_t(q_begin + row / group) * a.num_heads + head) * D;
#pragma unroll
      for (int c = 0; c < kLaneDims; ++c)
        if (lane + 32 * c < D) out[lane + 32 * c] = from_float<T>(too_long ? NAN : acc[i][c] * inv);
    } else {
      const std::int64_t idx = (std::int64_t(seq) * a.num_heads + head) * a.max_splits + split;
#pragma unroll
      for (int c = 0; c < kLaneDims; ++c)
        if (lane + 32 * c < D) a.split_out[idx * D + lane + 32 * c] = acc[i][c] * inv;
      if (lane == 0) {
        a.split_max_sum[2 * idx] = m[i];
        a.split_max_sum[2 * idx + 1] = l[i];
      }
    }
  }
}

// grid (num_heads, num_seqs), D threads: combine a split decode's partitions.
template <typename T, int D>
__global__ void __launch_bounds__(D) split_reduce_kernel(AttentionArgs a) {
  const int head = blockIdx.x, seq = blockIdx.y, d = threadIdx.x;
  const int splits = decode_partitions(a.seq_lens[seq], a.sliding_window);
  if (splits <= 1 || splits > a.max_splits) return;  // written directly by attention_kernel (NaN when too long)
  const std::int64_t base = (std::int64_t(seq) * a.num_heads + head) * a.max_splits;
  float global_max = -INFINITY;
  for (int s = 0; s < splits; ++s) global_max = fmaxf(global_max, a.split_max_sum[2 * (base + s)]);
  float total = 0.f, o = 0.f;
  for (int s = 0; s < splits; ++s) {
    const float sum = a.split_max_sum[2 * (base + s) + 1];
    const float w = sum > 0.f ? sum * expf(a.split_max_sum[2 * (base + s)] - global_max) : 0.f;
    total += w;
    o += w * a.split_out[(base + s) * D + d];
  }
  static_cast<T*>(a.out)[(std::int64_t(seq) * a.num_heads + head) * D + d] =
      from_float<T>(total > 0.f ? o / total : 0.f);
}

template <typename T, int D>
void launch(const AttentionArgs& a, const CacheGeometry& g, dim3 grid, int grid_splits, cudaStream_t stream) {
  const char* op = a.query_start_loc ? "prefill_attention" : "paged_attention";
  allow_shared_memory(attention_kernel<T, D>, smem_bytes<D>(), op);
  attention_kernel<T, D><<<grid, kThreads, smem_bytes<D>(), stream>>>(a, g.num_kv_heads, g.block_size,
                                                                      g.num_blocks, grid_splits);
  check_launch(op);
  if (!a.query_start_loc && a.max_splits > 1) {
    split_reduce_kernel<T, D><<<dim3(a.num_heads, a.num_seqs), D, 0, stream>>>(a);
    check_launch("paged_attention (split reduction)");
  }
}

}  // namespace

int decode_max_splits(int max_blocks_per_seq, int block_size, int sliding_window) {
  long long keys = static_cast<long long>(max_blocks_per_seq) * block_size;
  if (sliding_window > 0 && sliding_window < keys) keys = sliding_window;
  return static_cast<int>((keys + kSplitPartition - 1) / kSplitPartition);
}

void paged_attention(const AttentionArgs& a, const CacheGeometry& g, std::uintptr_t stream) {
  const char* op = a.query_start_loc ? "prefill_attention" : "paged_attention";
  if (a.num_seqs == 0) return;
  const bool decode = a.query_start_loc == nullptr;
  if (!decode && g.dtype != DType::F32) {
    prefill_tensor_core(a, g, as_stream(stream));
    return;
  }
  const int group = a.num_heads / g.num_kv_heads;
  const long long row_tiles = ((decode ? 1LL : a.max_query_len) * group + kRowsPerCta - 1) / kRowsPerCta;
  const int grid_splits = decode ? a.max_splits : 1;
  const long long grid_x = row_tiles * grid_splits;
  if (a.num_seqs > 65535 || g.num_kv_heads > 65535 || grid_x > 2147483647LL || grid_x < 1)
    throw std::invalid_argument(std::string(op) + ": launch too large (" + std::to_string(a.num_seqs) +
                                " sequences (<= 65535), " + std::to_string(g.num_kv_heads) + " kv heads (<= 65535), " +
                                std::to_string(grid_x) + " row tiles x partitions (<= 2^31 - 1))");
  const dim3 grid(static_cast<unsigned>(grid_x), a.num_seqs, g.num_kv_heads);
  dispatch_dtype(g.dtype, [&](auto tag) {
    using T = decltype(tag);
    dispatch_head_size(g.head_size, [&](auto d) { launch<T, decltype(d)::value>(a, g, grid, grid_splits,
                                                                               as_stream(stream)); });
  });
}

}  // namespace paged::cuda

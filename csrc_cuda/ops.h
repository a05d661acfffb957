// The host-side API of the CUDA kernels, in plain C++ types so that the
// nanobind bindings (bindings.cpp, compiled by the host compiler) never see
// CUDA headers. Every launcher enqueues on `stream` (a cudaStream_t passed as
// an integer from torch.cuda.current_stream().cuda_stream), checks the launch
// and throws std::runtime_error("<op>: <CUDA error string>") on failure.
// Arguments arrive already validated by bindings.cpp.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>

namespace paged::cuda {

enum class DType { F32, F16, BF16 };

// Number of visible CUDA devices; 0 (never an exception) without a driver or GPU.
int device_count() noexcept;
// "major.minor" compute capability of `device`, or -1 when it cannot be read.
int compute_capability(int device) noexcept;

// Head sizes the attention kernels are instantiated for (each one costs
// compile time: 3 dtypes x 2 kernels x archs); bindings.cpp rejects others.
constexpr int kHeadSizes[] = {64, 80, 96, 112, 128, 256};
constexpr bool supported_head_size(int d) {
  for (int h : kHeadSizes)
    if (h == d) return true;
  return false;
}

// Key cache and value cache share the layout [num_blocks, num_kv_heads, block_size, head_size].
struct CacheGeometry {
  int num_blocks, num_kv_heads, block_size, head_size;
  DType dtype;
  std::size_t elem_bytes() const { return dtype == DType::F32 ? 4 : 2; }
  std::size_t block_bytes() const {
    return std::size_t(num_kv_heads) * block_size * head_size * elem_bytes();
  }
};

void reshape_and_cache(const void* key, const void* value, void* key_cache, void* value_cache,
                       const std::int64_t* slot_mapping, int num_tokens, const CacheGeometry& g,
                       std::uintptr_t stream);

// Attention over the paged cache. Sequence s owns query rows
// [query_start_loc[s], query_start_loc[s+1]) which are its LAST positions;
// decode passes query_start_loc == nullptr (one row per sequence).
struct AttentionArgs {
  void* out;
  const void* query;  // [rows, num_heads, head_size]
  const void* key_cache;
  const void* value_cache;
  const int* block_tables;     // [num_seqs, max_blocks_per_seq]
  const int* seq_lens;         // [num_seqs]
  const int* query_start_loc;  // [num_seqs + 1] or nullptr (decode)
  int num_seqs, num_heads, max_blocks_per_seq, max_query_len;
  int num_query_rows;  // rows of query/out: a guard against stray query_start_loc values
  float scale;
  int sliding_window;  // 0 = unlimited
  // Split-K workspace (decode only): partial outputs [num_seqs, num_heads,
  // max_splits, head_size] and (max, sum) pairs [.., max_splits, 2], float32.
  float* split_out;
  float* split_max_sum;
  int max_splits;
};

// Keys per split-K partition; a decode sequence uses ceil(visible keys / this)
// partitions, a function of its own length only (batch-invariant results).
constexpr int kSplitPartition = 512;
// Partitions the decode workspace needs for tables this wide.
int decode_max_splits(int max_blocks_per_seq, int block_size, int sliding_window);

void paged_attention(const AttentionArgs& a, const CacheGeometry& g, std::uintptr_t stream);

// For each pair (src, dst) of the device-resident [num_pairs, 2] mapping:
// block dst <- block src, in the key and the value cache of one layer.
void copy_blocks(void* key_cache, void* value_cache, const std::int64_t* block_mapping,
                 int num_pairs, const CacheGeometry& g, std::uintptr_t stream);

// dst block <- src block (any mix of device and host memory) for each host-side
// pair, one cudaMemcpyAsync per block on `stream`.
void swap_blocks(const void* src, void* dst, const std::int64_t* host_block_mapping,
                 int num_pairs, std::size_t block_bytes, std::uintptr_t stream);

// One device allocation (cudaMalloc), freed by the destructor.
class DeviceArena {
 public:
  DeviceArena(std::size_t bytes, int device);
  void* data() const { return mem_.get(); }
  std::size_t size() const { return bytes_; }
  int device() const { return device_; }

 private:
  struct Free {
    void operator()(void* p) const noexcept;
  };
  std::unique_ptr<void, Free> mem_;
  std::size_t bytes_;
  int device_;
};

}  // namespace paged::cuda

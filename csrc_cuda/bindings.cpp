// paged._C_cuda: argument validation at the Python boundary and the module
// definition. Tensors arrive as DLPack capsules / objects (nanobind ndarray),
// so nothing here depends on torch. Everything that is cheap to check on the
// host (shapes, dtypes, devices, contiguity, host-side block ids) is checked
// once per call, naming the bad value; block ids that live on the GPU (block
// tables, slot mappings) are guarded inside the kernels and checked by the
// Python wrapper in debug mode (see docs/cuda.md). Alignment is checked
// first (alignment.h): a misaligned view must be a ValueError here, never a
// misaligned-address fault that poisons the CUDA context. Messages have the
// one shape of csrc_shared/arg_error.h: "<name>: expected <X>, got <Y>".
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <utility>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "alignment.h"
#include "arg_error.h"
#include "ops.h"

namespace nb = nanobind;
namespace pc = paged::cuda;
using Array = nb::ndarray<>;

namespace {

constexpr int kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3;

using paged::args::fail;
using paged::args::fail_index;

std::string shape_of(const Array& a) {
  std::string s = "(";
  for (size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

std::string dtype_name(const Array& a) {
  const auto dt = a.dtype();
  const char* kind = dt.code == uint8_t(nb::dlpack::dtype_code::Float)    ? "float"
                     : dt.code == uint8_t(nb::dlpack::dtype_code::Bfloat) ? "bfloat"
                     : dt.code == uint8_t(nb::dlpack::dtype_code::Int)    ? "int"
                     : dt.code == uint8_t(nb::dlpack::dtype_code::UInt)   ? "uint"
                                                                           : "other";
  return kind + std::to_string(dt.bits);
}

bool is_contiguous(const Array& a) {
  int64_t expect = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expect) return false;
    expect *= int64_t(a.shape(i));
  }
  return true;
}

bool is_float(const Array& a) {
  const auto code = a.dtype().code;
  return code == uint8_t(nb::dlpack::dtype_code::Float) || code == uint8_t(nb::dlpack::dtype_code::Bfloat);
}

// The data pointer's alignment (alignment.h), before anything else is read
// of the array: float rows move as 16-byte vectors, indices element-wise.
void check_alignment(const Array& a, const char* name) {
  const size_t align = pc::required_alignment(is_float(a), (a.dtype().bits * a.dtype().lanes + 7) / 8);
  if (const size_t off = pc::misalignment(a.data(), align))
    fail(name, pc::alignment_expected(align), pc::alignment_got(off));
}

// Every array of a call, before anything else about any of them: whatever
// else is wrong, a misaligned view is named as such.
void check_all_aligned(std::initializer_list<std::pair<const Array*, const char*>> arrays) {
  for (const auto& [a, name] : arrays) check_alignment(*a, name);
}

// Alignment, device, contiguity and rank of one argument.
void check_array(const Array& a, const char* name, size_t ndim, bool on_cuda = true) {
  check_alignment(a, name);
  if (on_cuda && a.device_type() != kDLCUDA)
    fail(name, "a CUDA tensor (DLPack device type " + std::to_string(kDLCUDA) + ")",
         "device type " + std::to_string(a.device_type()));
  if (a.ndim() != ndim) fail(name, "a " + std::to_string(ndim) + "-D tensor", "shape " + shape_of(a));
  if (!is_contiguous(a)) fail(name, "a contiguous tensor", "a strided one of shape " + shape_of(a));
}

void check_dim(const Array& a, const char* name, size_t dim, int64_t want) {
  if (int64_t(a.shape(dim)) != want)
    fail(name, "dim " + std::to_string(dim) + " = " + std::to_string(want), "shape " + shape_of(a));
}

void check_int(const Array& a, const char* name, int bits) {
  const auto dt = a.dtype();
  if (dt.code != uint8_t(nb::dlpack::dtype_code::Int) || dt.bits != bits || dt.lanes != 1)
    fail(name, "dtype int" + std::to_string(bits), dtype_name(a));
}

void check_same_device(const Array& a, const char* name, const Array& ref) {
  if (a.device_id() != ref.device_id())
    fail(name, "the cache's device cuda:" + std::to_string(ref.device_id()), "cuda:" + std::to_string(a.device_id()));
}

pc::DType element_type(const Array& a, const char* name) {
  const auto dt = a.dtype();
  if (dt.lanes == 1 && dt.code == uint8_t(nb::dlpack::dtype_code::Float) && dt.bits == 32) return pc::DType::F32;
  if (dt.lanes == 1 && dt.code == uint8_t(nb::dlpack::dtype_code::Float) && dt.bits == 16) return pc::DType::F16;
  if (dt.lanes == 1 && dt.code == uint8_t(nb::dlpack::dtype_code::Bfloat) && dt.bits == 16) return pc::DType::BF16;
  fail(name, "dtype float32, float16 or bfloat16", dtype_name(a));
}

std::string head_size_list() {
  std::string out;
  for (int h : pc::kHeadSizes) out += (out.empty() ? "" : ", ") + std::to_string(h);
  return out;
}

// The pair of caches of one layer: [num_blocks, num_kv_heads, block_size, head_size].
pc::CacheGeometry cache_geometry(const Array& key_cache, const Array& value_cache) {
  check_array(key_cache, "key_cache", 4);
  check_array(value_cache, "value_cache", 4);
  pc::CacheGeometry g{int(key_cache.shape(0)), int(key_cache.shape(1)), int(key_cache.shape(2)),
                      int(key_cache.shape(3)), element_type(key_cache, "key_cache")};
  if (shape_of(value_cache) != shape_of(key_cache))
    fail("value_cache", "key_cache's shape " + shape_of(key_cache), "shape " + shape_of(value_cache));
  if (element_type(value_cache, "value_cache") != g.dtype)
    fail("value_cache", "key_cache's dtype " + dtype_name(key_cache), dtype_name(value_cache));
  check_same_device(value_cache, "value_cache", key_cache);
  if (!pc::supported_head_size(g.head_size))
    fail("head_size (key_cache dim 3)", "one of " + head_size_list(), g.head_size);
  if (g.block_size < 1 || g.num_kv_heads < 1)
    fail("key_cache", "block_size and num_kv_heads >= 1", "shape " + shape_of(key_cache));
  return g;
}

// key/value/query/out rows: [rows, heads, head_size] in the cache's dtype.
void check_rows(const Array& a, const char* name, int64_t rows, int64_t heads, const pc::CacheGeometry& g,
                const Array& cache) {
  check_array(a, name, 3);
  if (rows >= 0) check_dim(a, name, 0, rows);
  check_dim(a, name, 1, heads);
  check_dim(a, name, 2, g.head_size);
  if (element_type(a, name) != g.dtype)
    fail(name, "the cache's dtype " + dtype_name(cache), dtype_name(a));
  check_same_device(a, name, cache);
}

void check_index(const Array& a, const char* name, size_t ndim, int bits, const Array& cache) {
  check_array(a, name, ndim);
  check_int(a, name, bits);
  check_same_device(a, name, cache);
}

void check_scale_window(double scale, int window) {
  if (!std::isfinite(scale) || scale == 0.0) fail("scale", "a finite non-zero number", scale);
  if (window < 0) fail("sliding_window", ">= 0 (0 = unlimited)", window);
}

// Shared by decode and prefill: query/out, caches, tables, lengths.
struct AttentionCheck {
  pc::CacheGeometry g;
  int num_heads, num_seqs;
};
AttentionCheck check_attention(const Array& out, const Array& query, const Array& key_cache,
                               const Array& value_cache, const Array& block_tables, const Array& seq_lens,
                               double scale, int window) {
  const pc::CacheGeometry g = cache_geometry(key_cache, value_cache);
  check_array(query, "query", 3);
  const int num_heads = int(query.shape(1));
  if (num_heads < 1 || num_heads % g.num_kv_heads)
    fail("query heads (dim 1)", "a positive multiple of num_kv_heads (" + std::to_string(g.num_kv_heads) + ")",
         num_heads);
  check_rows(query, "query", -1, num_heads, g, key_cache);
  check_rows(out, "out", int64_t(query.shape(0)), num_heads, g, key_cache);
  check_index(seq_lens, "seq_lens", 1, 32, key_cache);
  check_index(block_tables, "block_tables", 2, 32, key_cache);
  const int num_seqs = int(seq_lens.shape(0));
  if (int64_t(block_tables.shape(0)) != num_seqs)
    fail("block_tables", "one row per sequence (" + std::to_string(num_seqs) + " in seq_lens)",
         std::to_string(block_tables.shape(0)) + " rows");
  if (num_seqs && block_tables.shape(1) == 0) fail("block_tables", "at least one column", "shape " + shape_of(block_tables));
  check_scale_window(scale, window);
  return {g, num_heads, num_seqs};
}

pc::AttentionArgs make_args(const Array& out, const Array& query, const Array& key_cache,
                            const Array& value_cache, const Array& block_tables, const Array& seq_lens,
                            const AttentionCheck& c, double scale, int window) {
  pc::AttentionArgs a{};
  a.out = out.data();
  a.query = query.data();
  a.key_cache = key_cache.data();
  a.value_cache = value_cache.data();
  a.block_tables = static_cast<const int*>(block_tables.data());
  a.seq_lens = static_cast<const int*>(seq_lens.data());
  a.num_seqs = c.num_seqs;
  a.num_heads = c.num_heads;
  a.max_blocks_per_seq = int(block_tables.shape(1));
  a.num_query_rows = int(query.shape(0));
  a.scale = float(scale);
  a.sliding_window = window;
  a.max_splits = 1;
  return a;
}

void reshape_and_cache(const Array& key, const Array& value, const Array& key_cache, const Array& value_cache,
                       const Array& slot_mapping, std::uintptr_t stream) {
  check_all_aligned({{&key, "key"}, {&value, "value"}, {&key_cache, "key_cache"}, {&value_cache, "value_cache"},
                     {&slot_mapping, "slot_mapping"}});
  const pc::CacheGeometry g = cache_geometry(key_cache, value_cache);
  check_rows(key, "key", -1, g.num_kv_heads, g, key_cache);
  check_rows(value, "value", int64_t(key.shape(0)), g.num_kv_heads, g, key_cache);
  check_index(slot_mapping, "slot_mapping", 1, 64, key_cache);
  if (slot_mapping.shape(0) != key.shape(0))
    fail("slot_mapping", std::to_string(key.shape(0)) + " rows (one per key row)", slot_mapping.shape(0));
  pc::reshape_and_cache(key.data(), value.data(), key_cache.data(), value_cache.data(),
                        static_cast<const int64_t*>(slot_mapping.data()), int(key.shape(0)), g, stream);
}

void paged_attention(const Array& out, const Array& query, const Array& key_cache, const Array& value_cache,
                     const Array& block_tables, const Array& seq_lens, double scale, int sliding_window,
                     const Array& split_out, const Array& split_max_sum, int max_splits, std::uintptr_t stream) {
  check_all_aligned({{&out, "out"}, {&query, "query"}, {&key_cache, "key_cache"}, {&value_cache, "value_cache"},
                     {&block_tables, "block_tables"}, {&seq_lens, "seq_lens"}, {&split_out, "split_out"},
                     {&split_max_sum, "split_max_sum"}});
  const AttentionCheck c =
      check_attention(out, query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window);
  if (int64_t(query.shape(0)) != c.num_seqs)
    fail("seq_lens", "one entry per query row (" + std::to_string(query.shape(0)) + ")",
         std::to_string(c.num_seqs) + " entries");
  pc::AttentionArgs a = make_args(out, query, key_cache, value_cache, block_tables, seq_lens, c, scale, sliding_window);
  // The launch's partitions per sequence: the caller sizes it by the step's
  // longest decode (backends/cuda/launch.py); more than the table can hold
  // would only launch CTAs that exit.
  const int table_splits = std::max(1, pc::decode_max_splits(a.max_blocks_per_seq, c.g.block_size, sliding_window));
  if (max_splits < 1 || max_splits > table_splits)
    fail("max_splits", "in [1, " + std::to_string(table_splits) + "] (partitions of the block table's " +
                           std::to_string(a.max_blocks_per_seq) + " blocks)", max_splits);
  a.max_splits = max_splits;
  if (a.max_splits > 1) {
    check_array(split_out, "split_out", 4);
    check_array(split_max_sum, "split_max_sum", 4);
    const int64_t want[4] = {c.num_seqs, c.num_heads, a.max_splits, c.g.head_size};
    for (int d = 0; d < 4; ++d) {
      check_dim(split_out, "split_out", d, want[d]);
      check_dim(split_max_sum, "split_max_sum", d, d == 3 ? 2 : want[d]);
    }
    for (const auto* w : {&split_out, &split_max_sum}) {
      if (element_type(*w, "split workspace") != pc::DType::F32) fail("split workspace", "float32", dtype_name(*w));
      check_same_device(*w, "split workspace", key_cache);
    }
    a.split_out = static_cast<float*>(split_out.data());
    a.split_max_sum = static_cast<float*>(split_max_sum.data());
  }
  pc::paged_attention(a, c.g, stream);
}

void prefill_attention(const Array& out, const Array& query, const Array& key_cache, const Array& value_cache,
                       const Array& query_start_loc, const Array& seq_lens, const Array& block_tables,
                       int max_query_len, double scale, int sliding_window, std::uintptr_t stream) {
  check_all_aligned({{&out, "out"}, {&query, "query"}, {&key_cache, "key_cache"}, {&value_cache, "value_cache"},
                     {&query_start_loc, "query_start_loc"}, {&seq_lens, "seq_lens"}, {&block_tables, "block_tables"}});
  const AttentionCheck c =
      check_attention(out, query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window);
  check_index(query_start_loc, "query_start_loc", 1, 32, key_cache);
  check_dim(query_start_loc, "query_start_loc", 0, int64_t(c.num_seqs) + 1);
  if (max_query_len < 1 || max_query_len > int64_t(query.shape(0)))
    fail("max_query_len", "in [1, " + std::to_string(query.shape(0)) + "] (query rows)", max_query_len);
  pc::AttentionArgs a = make_args(out, query, key_cache, value_cache, block_tables, seq_lens, c, scale, sliding_window);
  a.query_start_loc = static_cast<const int*>(query_start_loc.data());
  a.max_query_len = max_query_len;
  pc::paged_attention(a, c.g, stream);
}

void copy_blocks(const std::vector<Array>& key_caches, const std::vector<Array>& value_caches,
                 const Array& block_mapping, std::uintptr_t stream) {
  if (key_caches.size() != value_caches.size())
    fail("value_caches", "one per layer of key_caches (" + std::to_string(key_caches.size()) + ")",
         value_caches.size());
  if (key_caches.empty()) return;
  for (size_t i = 0; i < key_caches.size(); ++i)
    check_all_aligned({{&key_caches[i], "key_caches[i]"}, {&value_caches[i], "value_caches[i]"}});
  const pc::CacheGeometry g = cache_geometry(key_caches[0], value_caches[0]);
  check_index(block_mapping, "block_mapping", 2, 64, key_caches[0]);
  check_dim(block_mapping, "block_mapping", 1, 2);
  for (size_t i = 0; i < key_caches.size(); ++i) {
    cache_geometry(key_caches[i], value_caches[i]);
    if (shape_of(key_caches[i]) != shape_of(key_caches[0]) || key_caches[i].dtype() != key_caches[0].dtype())
      fail("key_caches[" + std::to_string(i) + "]",
           "layer 0's shape and dtype " + shape_of(key_caches[0]) + " " + dtype_name(key_caches[0]),
           shape_of(key_caches[i]) + " " + dtype_name(key_caches[i]));
    check_same_device(key_caches[i], "key_caches[i]", key_caches[0]);
  }
  for (size_t i = 0; i < key_caches.size(); ++i)
    pc::copy_blocks(key_caches[i].data(), value_caches[i].data(), static_cast<const int64_t*>(block_mapping.data()),
                    int(block_mapping.shape(0)), g, stream);
}

void swap_blocks(const Array& src, const Array& dst, const Array& block_mapping, std::uintptr_t stream) {
  for (auto [a, name] : {std::pair{&src, "src_cache"}, std::pair{&dst, "dst_cache"}}) {
    const int dev = a->device_type();
    if (dev != kDLCUDA && dev != kDLCPU && dev != kDLCUDAHost)
      fail(name, "a CUDA or (pinned) host tensor", "DLPack device type " + std::to_string(dev));
    check_array(*a, name, src.ndim(), false);
  }
  if (src.ndim() < 1) fail("src_cache", "a block dimension", "shape " + shape_of(src));
  if (src.dtype() != dst.dtype()) fail("dst_cache", "src_cache's dtype " + dtype_name(src), dtype_name(dst));
  for (size_t d = 1; d < src.ndim(); ++d) check_dim(dst, "dst_cache", d, int64_t(src.shape(d)));
  check_array(block_mapping, "block_mapping", 2, false);
  check_int(block_mapping, "block_mapping", 64);
  check_dim(block_mapping, "block_mapping", 1, 2);
  if (block_mapping.device_type() != kDLCPU)
    fail("block_mapping (swap_blocks)", "a CPU tensor", "DLPack device type " + std::to_string(block_mapping.device_type()));
  const auto* m = static_cast<const int64_t*>(block_mapping.data());
  const int64_t limits[2] = {int64_t(src.shape(0)), int64_t(dst.shape(0))};
  for (size_t i = 0; i < block_mapping.shape(0); ++i)
    for (int col = 0; col < 2; ++col)
      if (m[2 * i + col] < 0 || m[2 * i + col] >= limits[col])
        fail_index("block_mapping[" + std::to_string(i) + ", " + std::to_string(col) + "]",
                   std::string("a ") + (col ? "destination" : "source") + " block id in [0, " +
                       std::to_string(limits[col]) + ")",
                   m[2 * i + col]);
  const size_t block_bytes = src.nbytes() / (src.shape(0) ? src.shape(0) : 1);
  pc::swap_blocks(src.data(), dst.data(), m, int(block_mapping.shape(0)), block_bytes, stream);
}

// A torch tensor over [offset, offset + bytes) of the arena; the arena stays
// alive while any such view does.
nb::ndarray<nb::pytorch> arena_view(pc::DeviceArena& arena, size_t offset, const std::vector<size_t>& shape,
                                    const std::string& dtype) {
  nb::dlpack::dtype dt;
  size_t elem = 2;
  if (dtype == "float32") dt = nb::dtype<float>(), elem = 4;
  else if (dtype == "float16") dt = {uint8_t(nb::dlpack::dtype_code::Float), 16, 1};
  else if (dtype == "bfloat16") dt = {uint8_t(nb::dlpack::dtype_code::Bfloat), 16, 1};
  else fail("dtype", "float32, float16 or bfloat16", "'" + dtype + "'");
  size_t bytes = elem;
  for (size_t s : shape) bytes *= s;
  if (offset % 256) fail("offset", "a multiple of 256 bytes", offset);
  if (offset > arena.size() || bytes > arena.size() - offset)
    fail_index("view", "offset + bytes <= the arena's " + std::to_string(arena.size()) + " bytes",
               std::to_string(bytes) + " bytes at offset " + std::to_string(offset));
  return nb::ndarray<nb::pytorch>(static_cast<char*>(arena.data()) + offset, shape.size(), shape.data(),
                                  nb::find(&arena), nullptr, dt, kDLCUDA, arena.device());
}

}  // namespace

NB_MODULE(_C_cuda, m) {
  m.doc() = "paged CUDA kernels and the KV device arena (importable without a GPU or driver); block accounting is the host's (paged._C_cpu.BlockPool)";
#ifdef PAGED_CUDA_ARCHS
  m.attr("built_archs") = PAGED_CUDA_ARCHS;
#else
  m.attr("built_archs") = "";
#endif
  m.attr("split_partition") = pc::kSplitPartition;
  nb::list head_sizes;
  for (int h : pc::kHeadSizes) head_sizes.append(h);
  m.attr("head_sizes") = nb::tuple(head_sizes);
  m.def("device_count", &pc::device_count, "Visible CUDA devices; 0 without a driver or GPU.");
  m.def("compute_capability", &pc::compute_capability, nb::arg("device"),
        "major*10+minor of a device, -1 when it cannot be read.");
  m.def("decode_max_splits", &pc::decode_max_splits, nb::arg("max_blocks_per_seq"), nb::arg("block_size"),
        nb::arg("sliding_window"), "Split-K partitions the decode workspace needs for this table width.");
  m.def("reshape_and_cache", &reshape_and_cache, nb::arg("key"), nb::arg("value"), nb::arg("key_cache"),
        nb::arg("value_cache"), nb::arg("slot_mapping"), nb::arg("stream"));
  m.def("paged_attention", &paged_attention, nb::arg("out"), nb::arg("query"), nb::arg("key_cache"),
        nb::arg("value_cache"), nb::arg("block_tables"), nb::arg("seq_lens"), nb::arg("scale"),
        nb::arg("sliding_window"), nb::arg("split_out"), nb::arg("split_max_sum"), nb::arg("max_splits"),
        nb::arg("stream"));
  m.def("prefill_attention", &prefill_attention, nb::arg("out"), nb::arg("query"), nb::arg("key_cache"),
        nb::arg("value_cache"), nb::arg("query_start_loc"), nb::arg("seq_lens"), nb::arg("block_tables"),
        nb::arg("max_query_len"), nb::arg("scale"), nb::arg("sliding_window"), nb::arg("stream"));
  m.def("copy_blocks", &copy_blocks, nb::arg("key_caches"), nb::arg("value_caches"), nb::arg("block_mapping"),
        nb::arg("stream"));
  m.def("swap_blocks", &swap_blocks, nb::arg("src_cache"), nb::arg("dst_cache"), nb::arg("block_mapping"),
        nb::arg("stream"));
  nb::class_<pc::DeviceArena>(m, "DeviceArena", "One cudaMalloc'd region, freed when the last view goes.")
      .def(nb::init<size_t, int>(), nb::arg("nbytes"), nb::arg("device") = 0)
      .def_prop_ro("nbytes", &pc::DeviceArena::size)
      .def_prop_ro("device", &pc::DeviceArena::device)
      .def("view", &arena_view, nb::arg("offset"), nb::arg("shape"), nb::arg("dtype"));
}

// nanobind binding of the shared block accounting, used by every platform
// module so the Python API of `BlockPool` is identical everywhere:
//
//   paged::bind_block_pool<paged::BlockAllocator>(m, "BlockPool");
//   paged::bind_block_hash(m);   // module function hash_block(parent, tokens, extra=None)
//
// A platform that keeps device memory behind the pool derives from
// BlockAllocator (constructor taking int64 num_blocks first) and adds its own
// methods on the class_ returned here.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unordered_map.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "block_allocator.h"
#include "block_hash.h"

namespace paged {

inline nanobind::dict block_pool_stats_dict(const BlockPoolStats& s) {
  nanobind::dict d;
  d["num_blocks"] = s.num_blocks;
  d["used"] = s.used;
  d["free"] = s.free;
  d["cached"] = s.cached;
  d["evictable"] = s.evictable;
  d["usage"] = s.num_blocks ? static_cast<double>(s.used) / static_cast<double>(s.num_blocks) : 0.0;
  d["prefix_queries"] = s.prefix_queries;
  d["prefix_hits"] = s.prefix_hits;
  d["hit_rate"] = s.prefix_queries ? static_cast<double>(s.prefix_hits) / static_cast<double>(s.prefix_queries) : 0.0;
  return d;
}

template <class Pool, class... Extra>
nanobind::class_<Pool, Extra...> bind_block_pool(nanobind::module_& m, const char* name) {
  static_assert(std::is_base_of_v<BlockAllocator, Pool>, "Pool must derive from paged::BlockAllocator");
  namespace nb = nanobind;
  using namespace nb::literals;
  nb::class_<Pool, Extra...> cls(m, name,
      "Fixed pool of KV blocks: ref counts, LRU free queue of evictable cached blocks, "
      "hash -> block map for prefix caching, copy-on-write (see docs/block-pool.md).");
  cls.def(nb::init<int64_t>(), "num_blocks"_a)
      .def_prop_ro("num_blocks", &Pool::num_blocks)
      .def_prop_ro("num_free", &Pool::num_free)
      .def("allocate", &Pool::allocate, "n"_a,
           "n blocks with ref count 1, or None (pool unchanged) when fewer than n are free.")
      .def("free", &Pool::free, "ids"_a, "Drop one reference per listed id.")
      .def("incref", &Pool::incref, "ids"_a, "Add one reference per listed (in-use) id.")
      .def("lookup_prefix", &Pool::lookup_prefix, "hashes"_a,
           "Blocks of the longest cached prefix of the given block hashes, one reference taken on each.")
      .def("register_hash", &Pool::register_hash, "block"_a, "hash"_a,
           "Record that a full in-use block holds `hash`; False when another block already does.")
      .def("cow", &Pool::cow, "block"_a,
           "Before writing a block: None if unshared, else (src, dst) with the reference moved to dst.")
      .def("mark_written", &Pool::mark_written, "block"_a,
           "Raise ValueError when the block is free or shared (write without copy-on-write).")
      .def("ref_count", &Pool::ref_count, "block"_a)
      .def("block_hash", &Pool::block_hash, "block"_a)
      .def("free_queue", &Pool::free_queue, "Free block ids, next to be reused first.")
      .def("cached_blocks", &Pool::cached_blocks, "dict hash -> block of every cached block.")
      .def("stats", [](const Pool& p) { return block_pool_stats_dict(p.stats()); });
  return cls;
}

inline void bind_block_hash(nanobind::module_& m) {
  namespace nb = nanobind;
  using namespace nb::literals;
  m.def(
      "hash_block",
      [](uint64_t parent, const std::vector<int64_t>& tokens, std::optional<std::string> extra) {
        if (!extra) return hash_block(parent, tokens.data(), tokens.size(), nullptr);
        const std::string_view view(*extra);
        return hash_block(parent, tokens.data(), tokens.size(), &view);
      },
      "parent"_a, "tokens"_a, "extra"_a = nb::none(),
      "64-bit content hash of one KV block: hash(parent hash, token ids, optional extra key).");
}

}  // namespace paged

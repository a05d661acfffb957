// Block accounting shared by every platform: fixed number of KV blocks, a ref
// count per block, an LRU free queue in which freed blocks that still hold a
// cached prefix stay reusable until evicted, a hash -> block map for automatic
// prefix caching, and copy-on-write. Header-only and free of any device or
// Python dependency; each platform module binds it (block_pool_bindings.h)
// and decides where the block memory itself lives.
//
// Rules (docs/block-pool.md is the long form, core/engine/block_pool_spec.py the
// executable one):
//  * allocate takes blocks from the head of the free queue; a block that
//    still holds a cached hash loses it there (eviction on reuse).
//  * free pushes blocks whose ref count reaches 0 in reverse order of the
//    call's list: never-hashed blocks to the head (reused first, they are
//    worth nothing), hashed blocks to the tail (evicted last, and a request's
//    later blocks before its earlier ones, since a prefix is only reachable
//    through its first blocks).
//  * every call validates all its arguments before changing anything, so a
//    failed call leaves the pool exactly as it was.
//  * all public methods lock one mutex: the engine drives the pool from one
//    thread while the server may read stats from another.
#pragma once

#include <cstdint>
#include <limits>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "block_hash.h"

namespace paged {

using BlockId = int32_t;

struct BlockPoolStats {
  int64_t num_blocks = 0;
  int64_t used = 0;       // blocks with ref count > 0
  int64_t free = 0;       // blocks in the free queue (ref count 0)
  int64_t cached = 0;     // blocks holding a registered prefix hash (used or free)
  int64_t evictable = 0;  // free blocks still holding a cached prefix
  int64_t prefix_queries = 0;  // block hashes looked up
  int64_t prefix_hits = 0;     // of which were served from the cache
};

class BlockAllocator {
 public:
  explicit BlockAllocator(int64_t num_blocks) {
    if (num_blocks <= 0 || num_blocks > std::numeric_limits<BlockId>::max())
      throw std::invalid_argument("num_blocks must be in [1, 2^31-1], got " + std::to_string(num_blocks));
    const auto n = static_cast<size_t>(num_blocks);
    ref_.assign(n, 0);
    hash_.assign(n, 0);
    has_hash_.assign(n, 0);
    prev_.assign(n, kNone);
    next_.assign(n, kNone);
    for (BlockId b = 0; b < static_cast<BlockId>(n); ++b) push_back(b);
  }

  BlockAllocator(const BlockAllocator&) = delete;
  BlockAllocator& operator=(const BlockAllocator&) = delete;

  int64_t num_blocks() const { return static_cast<int64_t>(ref_.size()); }

  // n fresh blocks with ref count 1, or nullopt (nothing changed) when fewer
  // than n blocks are free.
  std::optional<std::vector<BlockId>> allocate(int64_t n) {
    if (n < 0) throw std::invalid_argument("allocate: n must be >= 0, got " + std::to_string(n));
    std::lock_guard<std::mutex> lock(mu_);
    if (n > num_free_) return std::nullopt;
    std::vector<BlockId> out;
    out.reserve(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) out.push_back(take_head());
    return out;
  }

  // Drops one reference per listed id (an id listed twice drops two).
  void free(const std::vector<BlockId>& ids) {
    std::lock_guard<std::mutex> lock(mu_);
    check_ids(ids, "free");
    std::vector<BlockId> released;
    for (size_t i = 0; i < ids.size(); ++i) {
      const BlockId b = ids[i];
      if (ref_[b] == 0) {
        for (size_t j = i; j-- > 0;) ++ref_[ids[j]];  // undo: leave the pool unchanged
        throw std::invalid_argument(
            "free: block " + std::to_string(b) +
            (count_of(ids, b, i) ? " has no reference left (ref count underflow)" : " is already free (double free)"));
      }
      if (--ref_[b] == 0) released.push_back(b);
    }
    for (size_t i = released.size(); i-- > 0;) {
      const BlockId b = released[i];
      if (has_hash_[b]) push_back(b); else push_front(b);
    }
  }

  // Adds one reference per listed id; every id must be in use.
  void incref(const std::vector<BlockId>& ids) {
    std::lock_guard<std::mutex> lock(mu_);
    check_ids(ids, "incref");
    for (BlockId b : ids)
      if (ref_[b] == 0) throw std::invalid_argument("incref: block " + std::to_string(b) + " is free");
    for (BlockId b : ids) {
      if (ref_[b] == std::numeric_limits<int32_t>::max())
        throw std::overflow_error("incref: ref count overflow on block " + std::to_string(b));
    }
    for (BlockId b : ids) ++ref_[b];
  }

  // The blocks of the longest cached prefix of `hashes`, one reference taken
  // on each (a cached free block leaves the free queue: a touch).
  std::vector<BlockId> lookup_prefix(const std::vector<uint64_t>& hashes) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<BlockId> out;
    for (uint64_t h : hashes) {
      auto it = cached_.find(h);
      if (it == cached_.end()) break;
      const BlockId b = it->second;
      if (ref_[b] == 0) unlink(b);
      ++ref_[b];
      out.push_back(b);
    }
    prefix_queries_ += static_cast<int64_t>(hashes.size());
    prefix_hits_ += static_cast<int64_t>(out.size());
    return out;
  }

  // Records that in-use `block` is full and holds content `hash`. Returns
  // false when another block already holds that hash (the block then stays
  // uncached); re-registering the same hash is a no-op.
  bool register_hash(BlockId block, uint64_t hash) {
    std::lock_guard<std::mutex> lock(mu_);
    check_in_use(block, "register_hash");
    if (has_hash_[block]) {
      if (hash_[block] == hash) return true;
      throw std::invalid_argument("register_hash: block " + std::to_string(block) +
                                  " already holds a different hash");
    }
    if (!cached_.emplace(hash, block).second) return false;
    hash_[block] = hash;
    has_hash_[block] = 1;
    return true;
  }

  // Copy-on-write before writing into `block`: nullopt when the caller holds
  // the only reference (write in place); otherwise a new block is allocated,
  // the caller's reference moves to it and (src, dst) is returned for the
  // runner to copy. Throws std::runtime_error when no block is free.
  std::optional<std::pair<BlockId, BlockId>> cow(BlockId block) {
    std::lock_guard<std::mutex> lock(mu_);
    check_in_use(block, "cow");
    if (ref_[block] == 1) return std::nullopt;
    if (num_free_ == 0)
      throw std::runtime_error("cow: no free block to copy shared block " + std::to_string(block) + " into");
    const BlockId dst = take_head();
    --ref_[block];
    return std::make_pair(block, dst);
  }

  // Asserts that writing into `block` is safe: in use and not shared.
  void mark_written(BlockId block) const {
    std::lock_guard<std::mutex> lock(mu_);
    check_in_use(block, "mark_written");
    if (ref_[block] > 1)
      throw std::invalid_argument("write to shared block " + std::to_string(block) + " (ref count " +
                                  std::to_string(ref_[block]) + ") without copy-on-write");
  }

  int32_t ref_count(BlockId block) const {
    std::lock_guard<std::mutex> lock(mu_);
    check_id(block, "ref_count");
    return ref_[block];
  }

  std::optional<uint64_t> block_hash(BlockId block) const {
    std::lock_guard<std::mutex> lock(mu_);
    check_id(block, "block_hash");
    if (!has_hash_[block]) return std::nullopt;
    return hash_[block];
  }

  int64_t num_free() const {
    std::lock_guard<std::mutex> lock(mu_);
    return num_free_;
  }

  // Free queue from head (next to be reused) to tail.
  std::vector<BlockId> free_queue() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<BlockId> out;
    out.reserve(static_cast<size_t>(num_free_));
    for (BlockId b = head_; b != kNone; b = next_[b]) out.push_back(b);
    return out;
  }

  std::unordered_map<uint64_t, BlockId> cached_blocks() const {
    std::lock_guard<std::mutex> lock(mu_);
    return cached_;
  }

  BlockPoolStats stats() const {
    std::lock_guard<std::mutex> lock(mu_);
    BlockPoolStats s;
    s.num_blocks = num_blocks();
    s.free = num_free_;
    s.used = s.num_blocks - num_free_;
    s.cached = static_cast<int64_t>(cached_.size());
    for (BlockId b = head_; b != kNone; b = next_[b]) s.evictable += has_hash_[b];
    s.prefix_queries = prefix_queries_;
    s.prefix_hits = prefix_hits_;
    return s;
  }

 private:
  static constexpr BlockId kNone = -1;

  void check_id(int64_t block, const char* what) const {
    if (block < 0 || block >= num_blocks())
      throw std::out_of_range(std::string(what) + ": unknown block id " + std::to_string(block) +
                              " (pool has " + std::to_string(num_blocks()) + " blocks)");
  }
  void check_ids(const std::vector<BlockId>& ids, const char* what) const {
    for (BlockId b : ids) check_id(b, what);
  }
  void check_in_use(BlockId block, const char* what) const {
    check_id(block, what);
    if (ref_[block] == 0) throw std::invalid_argument(std::string(what) + ": block " + std::to_string(block) + " is free");
  }
  static bool count_of(const std::vector<BlockId>& ids, BlockId b, size_t before) {
    for (size_t j = 0; j < before; ++j)
      if (ids[j] == b) return true;
    return false;
  }

  // Pops the free-queue head, evicting its cached hash, with ref count 1.
  BlockId take_head() {
    const BlockId b = head_;
    unlink(b);
    if (has_hash_[b]) {
      cached_.erase(hash_[b]);
      has_hash_[b] = 0;
      hash_[b] = 0;
    }
    ref_[b] = 1;
    return b;
  }

  void unlink(BlockId b) {
    const BlockId p = prev_[b], n = next_[b];
    (p == kNone ? head_ : next_[p]) = n;
    (n == kNone ? tail_ : prev_[n]) = p;
    prev_[b] = next_[b] = kNone;
    --num_free_;
  }
  void push_back(BlockId b) {
    prev_[b] = tail_;
    next_[b] = kNone;
    (tail_ == kNone ? head_ : next_[tail_]) = b;
    tail_ = b;
    ++num_free_;
  }
  void push_front(BlockId b) {
    next_[b] = head_;
    prev_[b] = kNone;
    (head_ == kNone ? tail_ : prev_[head_]) = b;
    head_ = b;
    ++num_free_;
  }

  mutable std::mutex mu_;
  std::vector<int32_t> ref_;
  std::vector<uint64_t> hash_;
  std::vector<uint8_t> has_hash_;
  std::vector<BlockId> prev_, next_;  // intrusive doubly linked free queue
  BlockId head_ = kNone, tail_ = kNone;
  int64_t num_free_ = 0;
  std::unordered_map<uint64_t, BlockId> cached_;
  int64_t prefix_queries_ = 0, prefix_hits_ = 0;
};

}  // namespace paged

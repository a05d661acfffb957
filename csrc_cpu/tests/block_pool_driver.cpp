// Exercises csrc_shared/block_allocator.h directly (no Python): the
// allocation / free / prefix / CoW rules, every misuse path, and a threaded
// stress. Built with ASan+UBSan by tests/test_block_pool_sanitizers.py; exits
// non-zero on the first failed check.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "block_allocator.h"
#include "block_hash.h"

using paged::BlockAllocator;
using paged::BlockId;

namespace {

std::atomic<int> g_failures{0};

#define CHECK(cond)                                                        \
  do {                                                                     \
    if (!(cond)) {                                                         \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++g_failures;                                                        \
    }                                                                      \
  } while (0)

// Runs fn, which must throw Exc whose message mentions `needle`.
template <class Exc, class Fn>
void expect_throw(Fn fn, const std::string& needle, int line) {
  try {
    fn();
  } catch (const Exc& e) {
    if (std::string(e.what()).find(needle) == std::string::npos) {
      std::fprintf(stderr, "line %d: message '%s' lacks '%s'\n", line, e.what(), needle.c_str());
      ++g_failures;
    }
    return;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "line %d: wrong exception type: %s\n", line, e.what());
    ++g_failures;
    return;
  }
  std::fprintf(stderr, "line %d: expected an exception\n", line);
  ++g_failures;
}
#define EXPECT_THROW(Exc, expr, needle) expect_throw<Exc>([&] { expr; }, needle, __LINE__)

void check_consistent(const BlockAllocator& pool) {
  const auto s = pool.stats();
  CHECK(s.free + s.used == s.num_blocks);
  const auto queue = pool.free_queue();
  CHECK(static_cast<int64_t>(queue.size()) == s.free);
  for (BlockId b : queue) CHECK(pool.ref_count(b) == 0);
  for (const auto& [h, b] : pool.cached_blocks()) CHECK(pool.block_hash(b) == h);
}

void test_basic_rules() {
  BlockAllocator pool(8);
  auto a = pool.allocate(3);
  CHECK(a && (*a == std::vector<BlockId>{0, 1, 2}));
  CHECK(!pool.allocate(6));  // only 5 free: refused, nothing changed
  CHECK(pool.num_free() == 5);
  CHECK(pool.register_hash(0, 100) && pool.register_hash(1, 101));
  CHECK(!pool.register_hash(2, 100));  // content already cached in block 0
  pool.free(*a);
  // uncached block 2 goes to the head, cached 1 and 0 to the tail (1 evicted before 0)
  const auto q = pool.free_queue();
  CHECK(q.front() == 2 && q[q.size() - 2] == 1 && q.back() == 0);
  CHECK(pool.stats().evictable == 2);
  auto hit = pool.lookup_prefix({100, 101, 102});
  CHECK((hit == std::vector<BlockId>{0, 1}));
  CHECK(pool.ref_count(0) == 1 && pool.num_free() == 6);
  CHECK(pool.stats().prefix_queries == 3 && pool.stats().prefix_hits == 2);
  pool.free(hit);
  // draining the pool evicts cached blocks last, and drops their hashes
  auto all = pool.allocate(8);
  CHECK(all && all->back() == 0 && pool.cached_blocks().empty());
  CHECK(pool.lookup_prefix({100}).empty());
  pool.free(*all);
  check_consistent(pool);
}

void test_cow() {
  BlockAllocator pool(4);
  auto a = *pool.allocate(1);
  CHECK(!pool.cow(a[0]));  // sole owner writes in place
  pool.incref(a);
  EXPECT_THROW(std::invalid_argument, pool.mark_written(a[0]), "shared block 0");
  auto copy = pool.cow(a[0]);
  CHECK(copy && copy->first == 0 && copy->second == 1);
  CHECK(pool.ref_count(0) == 1 && pool.ref_count(1) == 1);
  pool.mark_written(1);
  pool.free({0, 1});
  CHECK(pool.num_free() == 4);
  auto rest = *pool.allocate(4);
  pool.incref({rest[0]});
  EXPECT_THROW(std::runtime_error, pool.cow(rest[0]), "block " + std::to_string(rest[0]));
  CHECK(pool.ref_count(rest[0]) == 2);  // unchanged by the failed cow
  pool.free(rest);
  pool.free({rest[0]});
  check_consistent(pool);
}

void test_misuse() {
  EXPECT_THROW(std::invalid_argument, BlockAllocator(0), "num_blocks");
  BlockAllocator pool(4);
  EXPECT_THROW(std::out_of_range, pool.free({4}), "block id 4");
  EXPECT_THROW(std::out_of_range, pool.free({-1}), "block id -1");
  EXPECT_THROW(std::out_of_range, pool.incref({9}), "block id 9");
  EXPECT_THROW(std::out_of_range, pool.cow(17), "block id 17");
  EXPECT_THROW(std::out_of_range, pool.ref_count(-5), "block id -5");
  EXPECT_THROW(std::invalid_argument, pool.allocate(-1), "-1");
  EXPECT_THROW(std::invalid_argument, pool.free({2}), "block 2 is already free");
  auto a = *pool.allocate(2);
  EXPECT_THROW(std::invalid_argument, pool.free({a[0], a[1], a[1]}), "underflow");
  CHECK(pool.ref_count(a[0]) == 1 && pool.ref_count(a[1]) == 1);  // failed call changed nothing
  EXPECT_THROW(std::invalid_argument, pool.incref({a[0], 3}), "block 3 is free");
  CHECK(pool.ref_count(a[0]) == 1);
  EXPECT_THROW(std::invalid_argument, pool.register_hash(3, 7), "block 3 is free");
  EXPECT_THROW(std::invalid_argument, pool.mark_written(3), "block 3 is free");
  CHECK(pool.register_hash(a[0], 7));
  EXPECT_THROW(std::invalid_argument, pool.register_hash(a[0], 8), "different hash");
  pool.free(a);
  EXPECT_THROW(std::invalid_argument, pool.free({a[0]}), "double free");
  check_consistent(pool);
}

void test_hash() {
  const int64_t t[] = {1, 2, 3, -4};
  const std::string_view salt("salt"), empty("");
  const uint64_t h = paged::hash_block(0, t, 4, nullptr);
  CHECK(h == paged::hash_block(0, t, 4, nullptr));
  CHECK(h != paged::hash_block(1, t, 4, nullptr));
  CHECK(h != paged::hash_block(0, t, 3, nullptr));
  CHECK(h != paged::hash_block(0, t, 4, &salt));
  CHECK(paged::hash_block(0, t, 4, &empty) != paged::hash_block(0, t, 4, &salt));
}

// Several threads allocate, share, cache, look up, CoW and free at once while
// another reads stats; the pool must end consistent with every block free.
void test_threaded_stress() {
  constexpr int kBlocks = 256, kThreads = 4, kIters = 3000;
  BlockAllocator pool(kBlocks);
  std::atomic<bool> done{false};
  std::thread reader([&] {
    while (!done.load()) {
      const auto s = pool.stats();
      if (s.free + s.used != s.num_blocks) ++g_failures;
    }
  });
  std::vector<std::thread> workers;
  std::atomic<int> errors{0};
  for (int t = 0; t < kThreads; ++t) {
    workers.emplace_back([&, t] {
      std::mt19937_64 rng(1234 + t);
      for (int i = 0; i < kIters; ++i) {
        const uint64_t h0 = rng() % 32, h1 = 100 + rng() % 32;
        std::vector<BlockId> mine = pool.lookup_prefix({h0, h1});
        auto more = pool.allocate(1 + static_cast<int64_t>(rng() % 8));
        if (!more) { pool.free(mine); continue; }
        mine.insert(mine.end(), more->begin(), more->end());
        pool.register_hash(mine[0], pool.block_hash(mine[0]).value_or(h0));
        pool.incref({mine.back()});
        try {
          // we hold two references: cow moves one of them to a fresh copy
          if (auto c = pool.cow(mine.back())) mine.push_back(c->second);
          else ++errors;
        } catch (const std::runtime_error&) {
          pool.free({mine.back()});  // pool full: give the extra reference back
        } catch (...) {
          ++errors;
        }
        pool.free(mine);
      }
    });
  }
  for (auto& w : workers) w.join();
  done = true;
  reader.join();
  CHECK(errors.load() == 0);
  CHECK(pool.num_free() == kBlocks);
  check_consistent(pool);
}

}  // namespace

int main() {
  test_basic_rules();
  test_cow();
  test_misuse();
  test_hash();
  test_threaded_stress();
  if (g_failures) {
    std::fprintf(stderr, "block_pool_driver: %d failure(s)\n", g_failures.load());
    return 1;
  }
  std::printf("block_pool_driver: all checks passed\n");
  return 0;
}

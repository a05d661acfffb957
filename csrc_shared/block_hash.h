// Content hash of one full KV block for automatic prefix caching:
// hash(parent block hash, the block's token ids, optional extra key such as a
// cache salt). 64-bit, no per-process seed, so equal prefixes hash equal in
// every process; core/engine/block_pool_spec.py re-implements it in pure Python and
// the tests check both agree bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace paged {

// splitmix64's finaliser: a bijective 64-bit mixer with full avalanche.
inline uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

inline constexpr uint64_t kHashSeed = 0x70616765642d6b76ULL;   // "paged-kv"
inline constexpr uint64_t kTokenTag = 0x9e3779b97f4a7c15ULL;
inline constexpr uint64_t kExtraTag = 0xd6e8feb86659fd93ULL;

// 64-bit FNV-1a of the extra key's bytes (then mixed into the block hash).
inline uint64_t hash_bytes(std::string_view bytes) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return h;
}

// tokens[0..n) are hashed as their 64-bit two's-complement values; the token
// count is mixed in so blocks of different lengths never collide by padding.
inline uint64_t hash_block(uint64_t parent, const int64_t* tokens, size_t n,
                           const std::string_view* extra) {
  uint64_t h = mix64(parent ^ kHashSeed);
  for (size_t i = 0; i < n; ++i) h = mix64(h ^ mix64(static_cast<uint64_t>(tokens[i]) + kTokenTag));
  h = mix64(h ^ static_cast<uint64_t>(n));
  if (extra) h = mix64(h ^ mix64(hash_bytes(*extra) ^ kExtraTag));
  return h;
}

}  // namespace paged

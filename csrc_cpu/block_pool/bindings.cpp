// paged._C_cpu: the shared block accounting (host memory lives in the KV cache
// tensors, allocated through the NUMA host arena, see host_arena.cpp).
#include "block_pool_bindings.h"
#include "module.h"

namespace paged::cpu {
void register_host_arena(nanobind::module_& m);  // host_arena.cpp

void register_block_pool(nanobind::module_& m) {
  paged::bind_block_pool<paged::BlockAllocator>(m, "BlockPool");
  paged::bind_block_hash(m);
  register_host_arena(m);
}
}  // namespace paged::cpu

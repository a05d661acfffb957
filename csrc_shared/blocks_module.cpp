// paged._C_blocks: the block accounting every platform uses (block ids, ref
// counts, the LRU free queue, prefix hashes; block_allocator.h). Block ids
// never touch device memory, so one module serves the engine on any device;
// where each platform's KV memory lives is its worker's business.
#include "block_pool_bindings.h"

NB_MODULE(_C_blocks, m) {
  m.doc() = "paged's block accounting (BlockPool, hash_block), shared by every platform";
  paged::bind_block_pool<paged::BlockAllocator>(m, "BlockPool");
  paged::bind_block_hash(m);
}

// Portable build of the attention kernel (any x86-64 or other CPU).
#include "attention/kernel_common.h"

namespace paged::cpu::attn::isa_scalar {
#include "attention/vec_scalar.inc"
#include "attention/kernel_impl.inc"
}  // namespace paged::cpu::attn::isa_scalar

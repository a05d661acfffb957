#include "module.h"

namespace paged::cpu {
void register_block_pool(nanobind::module_& m) {}
}  // namespace paged::cpu

#include "module.h"

namespace paged::cpu {
void register_attention(nanobind::module_& m) {}
}  // namespace paged::cpu

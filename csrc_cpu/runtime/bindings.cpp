#include "module.h"

namespace paged::cpu {
void register_runtime(nanobind::module_& m) {}
}  // namespace paged::cpu

#include "module.h"

NB_MODULE(_C_cpu, m) {
  m.doc() = "paged CPU runtime (topology, pinning, NUMA memory) and kernels (block accounting: paged._C_blocks)";
  paged::cpu::register_runtime(m);
  paged::cpu::register_host_arena(m);
  paged::cpu::register_kv_arena(m);
  paged::cpu::register_attention(m);
  paged::cpu::register_linear(m);
  paged::cpu::register_ops(m);
  paged::cpu::register_model(m);
  paged::cpu::register_moe_experts(m);
  paged::cpu::register_kernel_builds(m);
}

#include "module.h"

NB_MODULE(_C_cpu, m) {
  m.doc() = "paged CPU runtime, block pool and attention kernels";
  paged::cpu::register_runtime(m);
  paged::cpu::register_block_pool(m);
  paged::cpu::register_attention(m);
  paged::cpu::register_linear(m);
  paged::cpu::register_ops(m);
  paged::cpu::register_model(m);
}

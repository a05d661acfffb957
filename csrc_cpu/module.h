// Registration entry points of the paged._C_cpu extension; each subsystem
// binds its own functions so the pieces stay in separate files.
#pragma once
#include <nanobind/nanobind.h>

namespace paged::cpu {
void register_runtime(nanobind::module_& m);     // runtime/: topology, pinning, NUMA memory
void register_host_arena(nanobind::module_& m);  // runtime/host_arena.cpp: NUMA host memory (numa_zeros)
void register_kv_arena(nanobind::module_& m);    // runtime/kv_arena.cpp: the KV cache's on-demand arena
void register_attention(nanobind::module_& m);   // attention/: paged attention + cache ops
void register_linear(nanobind::module_& m);      // linear/: linear layers on quantized weights
void register_ops(nanobind::module_& m);         // ops/: fused elementwise ops of the Llama layer
void register_model(nanobind::module_& m);       // model/: all decoder layers of a step in one call
void register_moe_experts(nanobind::module_& m);  // model/moe_experts.h: one MoE layer's experts in one call
void register_kernel_builds(nanobind::module_& m);  // kernel_builds.h: the SIMD builds of every kernel family
}  // namespace paged::cpu

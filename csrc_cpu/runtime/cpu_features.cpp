// CPU feature detection straight from CPUID, checked against what the OS
// enabled in XCR0: a CPU with AVX-512 whose kernel does not save ZMM state
// (or has not granted AMX tile state) cannot use those instructions.
#include "runtime/runtime.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace paged::cpu::runtime {
namespace {

#if defined(__x86_64__) || defined(__i386__)
struct Regs {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
};

Regs cpuid(unsigned leaf, unsigned subleaf) {
  Regs r;
  if (!__get_cpuid_count(leaf, subleaf, &r.eax, &r.ebx, &r.ecx, &r.edx)) return Regs{};
  return r;
}

bool bit(unsigned reg, int n) { return (reg >> n) & 1U; }

unsigned long long xcr0() {
  unsigned eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<unsigned long long>(edx) << 32) | eax;
}
#endif

}  // namespace

std::vector<std::pair<std::string, bool>> cpu_features() {
  bool avx2 = false, f16c = false, avx512f = false, avx512bf16 = false, avx512vnni = false,
       avx512fp16 = false, amx_tile = false, amx_bf16 = false, amx_int8 = false;
#if defined(__x86_64__) || defined(__i386__)
  const Regs leaf1 = cpuid(1, 0);
  const bool osxsave = bit(leaf1.ecx, 27);
  const unsigned long long xcr = osxsave ? xcr0() : 0;
  const bool ymm_os = (xcr & 0x6) == 0x6;            // SSE + AVX state
  const bool zmm_os = ymm_os && (xcr & 0xe0) == 0xe0;  // opmask + ZMM state
  const bool tile_os = (xcr & 0x60000) == 0x60000;   // XTILECFG + XTILEDATA
  const Regs leaf7 = cpuid(7, 0);
  const Regs leaf7_1 = leaf7.eax >= 1 ? cpuid(7, 1) : Regs{};
  f16c = ymm_os && bit(leaf1.ecx, 29);
  avx2 = ymm_os && bit(leaf7.ebx, 5);
  avx512f = zmm_os && bit(leaf7.ebx, 16);
  avx512vnni = avx512f && bit(leaf7.ecx, 11);
  avx512fp16 = avx512f && bit(leaf7.edx, 23);
  avx512bf16 = avx512f && bit(leaf7_1.eax, 5);
  amx_tile = tile_os && bit(leaf7.edx, 24);
  amx_bf16 = amx_tile && bit(leaf7.edx, 22);
  amx_int8 = amx_tile && bit(leaf7.edx, 25);
#endif
  return {{"avx2", avx2},
          {"f16c", f16c},
          {"avx512f", avx512f},
          {"avx512bf16", avx512bf16},
          {"avx512vnni", avx512vnni},
          {"avx512fp16", avx512fp16},
          {"amx_tile", amx_tile},
          {"amx_bf16", amx_bf16},
          {"amx_int8", amx_int8},
          {"amx", amx_bf16}};
}

}  // namespace paged::cpu::runtime

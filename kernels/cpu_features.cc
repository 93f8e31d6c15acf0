// See cpu_features.h.
#include "cpu_features.h"

#include <cstdlib>
#include <cstring>

#ifdef MLXCEL_X86
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace mlxcel::kernels::cpu {
namespace {

#ifdef MLXCEL_X86
// AMX-TILE and AMX-BF16 in CPUID leaf 7, and Linux grants the tile data state.
bool amx_granted() {
  if (const char* env = std::getenv("MLXCEL_AMX"); env && std::strcmp(env, "0") == 0) return false;
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tile = d & (1u << 24), bf16 = d & (1u << 22);
  if (!tile || !bf16) return false;
#if defined(__linux__) && defined(SYS_arch_prctl)
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
  return false;
#endif
}
#endif

Features detect() {
  Features f;
#ifdef MLXCEL_X86
  __builtin_cpu_init();
  f.avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  f.avx512 = f.avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  f.avx512_vnni = f.avx512 && __builtin_cpu_supports("avx512vnni");
  f.amx_bf16 = f.avx512 && amx_granted();
  f.amd = __builtin_cpu_is("amd");
#elif defined(__aarch64__)
  f.neon = true;
#endif
  return f;
}

}  // namespace

const Features& features() {
  static const Features f = detect();
  return f;
}

}  // namespace mlxcel::kernels::cpu

// What this CPU runs, detected once per process and shared by every kernel.
// x86-64 code paths are compiled only where MLXCEL_X86 is defined; elsewhere
// (aarch64 Linux, Apple Silicon) the kernels run their portable loops, which
// the compiler vectorizes for NEON.
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#define MLXCEL_X86 1
#endif

namespace mlxcel::kernels::cpu {

struct Features {
  bool avx2 = false;         // AVX2 + FMA + F16C
  bool avx512 = false;       // AVX-512 F + BW + VL + DQ
  bool avx512_vnni = false;  // avx512 + AVX512-VNNI
  bool amx_bf16 = false;     // AMX-TILE + AMX-BF16, tile state granted by the OS, MLXCEL_AMX != 0
  bool neon = false;         // aarch64 Advanced SIMD (always on aarch64)
  // AMD (Zen): the decode matvec prefetches its weight stream into L2
  // rather than L1 (measured 1.3-1.8x on the 8-bit lm_head on Zen 4).
  bool amd = false;
};

// Detected on first use (thread-safe), then constant.
const Features& features();

}  // namespace mlxcel::kernels::cpu

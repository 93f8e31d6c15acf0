// Memory for weights that decode streams once a token: 2 MiB-aligned chunks
// that Linux backs with transparent huge pages (madvise), so that streaming
// them walks one TLB entry per 2 MiB instead of one per 4 KiB page. On this
// project's 2-vCPU VMs that reads 96 MiB 1.2-1.6x faster (benches/membw.c).
// MLXCEL_HUGE_PAGES=0 leaves the pages at the system's default.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "mlx/mlx.h"

namespace mlxcel::kernels {

// An evaluated array of `shape` and `dtype` holding a copy of `bytes` bytes
// at `data` (exactly the array's size), in the weight arena. Throws
// std::invalid_argument when the sizes disagree and std::bad_alloc when no
// memory can be mapped.
mlx::core::array weight_array(const void* data, size_t bytes, const mlx::core::Shape& shape, mlx::core::Dtype dtype);

// Bytes of the arena's live allocations (weights and the VNNI copies).
size_t weight_arena_bytes();

// The arena's mapped bytes as the kernel reports them (/proc/self/smaps;
// zeros elsewhere than Linux): those in mappings eligible for transparent
// huge pages, those backed by huge pages now, and those resident.
struct ArenaPages {
  size_t eligible = 0, huge = 0, resident = 0;
};
ArenaPages weight_arena_pages();

// Whether the arena asks for huge pages (MLXCEL_HUGE_PAGES is not "0", and
// the system has transparent huge pages).
bool weight_arena_huge_pages();

namespace detail {

// `bytes` bytes, 64-byte aligned, in the arena; the memory lives as long as
// the returned owner (any copy of it), and its whole pages go back to the
// system when the owner is released.
struct ArenaSlice {
  uint8_t* data = nullptr;
  std::shared_ptr<void> owner;
};
ArenaSlice arena_allocate(size_t bytes);

// An evaluated array of `shape` and `dtype` over `bytes` bytes at `data`,
// memory MLX did not allocate; `release` runs when MLX frees the buffer.
// MLX's CPU buffers keep a header (the size) in front of the data, so the
// `header_room` bytes before `data` must be writable. Throws
// std::runtime_error naming `caller` if MLX's buffer layout does not allow it.
mlx::core::array array_over(uint8_t* data, size_t bytes, size_t header_room, const mlx::core::Shape& shape,
                            mlx::core::Dtype dtype, std::function<void()> release, const char* caller);

}  // namespace detail
}  // namespace mlxcel::kernels

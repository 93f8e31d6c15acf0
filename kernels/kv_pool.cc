// See kv_pool.h.

#include "kv_pool.h"

#include "kv_q8.h"
#include "weight_arena.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <new>
#include <stdexcept>
#include <string>

namespace mx = mlx::core;

namespace mlxcel::kernels {
namespace {

size_t page_size() {
  static const size_t page = (size_t)sysconf(_SC_PAGESIZE);
  return page;
}

// An evaluated, page-aligned array of `shape` over an anonymous mapping:
// the mapping starts one page early, for MLX's buffer header, so that the
// data, and with it every block, is page aligned.
mx::array mapped_array(const mx::Shape& shape, mx::Dtype dtype) {
  size_t bytes = dtype.size();
  for (int d : shape) bytes *= (size_t)d;
  const size_t page = page_size(), mapped = bytes + page;
  void* base = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) throw std::bad_alloc();
  try {
    return detail::array_over(static_cast<uint8_t*>(base) + page, bytes, page, shape, dtype,
                              [base, mapped] { munmap(base, mapped); }, "mlxcel::kernels::kv_pool_buffer");
  } catch (...) {
    munmap(base, mapped);
    throw;
  }
}

}  // namespace

mx::array kv_pool_buffer(int blocks, int kv_heads, int block, int head_dim) {
  if (blocks <= 0 || kv_heads <= 0 || block <= 0 || head_dim <= 0) {
    throw std::invalid_argument("[mlxcel::kernels::kv_pool_buffer] dimensions must be positive");
  }
  return mapped_array(mx::Shape{kv_heads, blocks, block, head_dim}, mx::float32);
}

mx::array kv_pool_buffer_q8(int blocks, int layers, int kv_heads, int block, int head_dim) {
  if (blocks <= 0 || layers <= 0 || kv_heads <= 0 || block <= 0 || head_dim <= 0) {
    throw std::invalid_argument("[mlxcel::kernels::kv_pool_buffer_q8] dimensions must be positive");
  }
  if (head_dim % detail::kKvQ8Group != 0) {
    throw std::invalid_argument("[mlxcel::kernels::kv_pool_buffer_q8] an 8-bit KV cache quantizes groups of " +
                                std::to_string(detail::kKvQ8Group) + " features; head_dim " +
                                std::to_string(head_dim) + " is not a multiple");
  }
  const detail::KvQ8Layout layout{layers, kv_heads, block, head_dim};
  return mapped_array(mx::Shape{blocks, layers, 2, kv_heads, (int)layout.section_bytes()}, mx::uint8);
}

void kv_pool_release(const mx::array& pool, const std::vector<int32_t>& ids) {
  const bool q8 = pool.ndim() == 5 && pool.dtype() == mx::uint8;
  if (!(q8 || (pool.ndim() == 4 && pool.dtype() == mx::float32)) || pool.status() == mx::array::unscheduled ||
      !pool.data<void>()) {
    throw std::invalid_argument("[mlxcel::kernels::kv_pool_release] not a pool");
  }
  // Runs of one block: per KV head in a float pool, one in an 8-bit pool.
  const int heads = q8 ? 1 : pool.shape(0), blocks = q8 ? pool.shape(0) : pool.shape(1);
  const size_t run_bytes = pool.nbytes() / ((size_t)heads * blocks), page = page_size();
  char* base = static_cast<char*>(const_cast<void*>(pool.data<void>()));
  for (int32_t id : ids) {
    if (id < 0 || id >= blocks) throw std::invalid_argument("[mlxcel::kernels::kv_pool_release] block id out of range");
    for (int h = 0; h < heads; ++h) {
      const uintptr_t start = (uintptr_t)(base + ((size_t)h * blocks + id) * run_bytes);
      const uintptr_t end = start + run_bytes;
      const uintptr_t first = (start + page - 1) / page * page, last = end / page * page;
      if (last > first) madvise((void*)first, last - first, MADV_DONTNEED);
    }
  }
}

size_t resident_bytes(const mx::array& a) {
  if (a.status() == mx::array::unscheduled || !a.data<void>()) {
    throw std::invalid_argument("[mlxcel::kernels::resident_bytes] the array is not evaluated");
  }
  const size_t page = page_size();
  const uintptr_t start = (uintptr_t)a.data<void>() / page * page;
  const uintptr_t end = (uintptr_t)a.data<char>() + a.nbytes();
  const size_t pages = (end - start + page - 1) / page;
#ifdef __APPLE__
  std::vector<char> in_core(pages);
#else
  std::vector<unsigned char> in_core(pages);
#endif
  if (mincore((void*)start, end - start, in_core.data()) != 0) {
    throw std::runtime_error("[mlxcel::kernels::resident_bytes] mincore failed");
  }
  size_t resident = 0;
  for (auto c : in_core) resident += (c & 1) ? page : 0;
  return resident;
}

}  // namespace mlxcel::kernels

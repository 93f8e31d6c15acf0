// See weight_arena.h.

#include "weight_arena.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace mx = mlx::core;

namespace mlxcel::kernels {
namespace {

constexpr size_t kHugePage = size_t{2} << 20;
constexpr size_t kChunkBytes = size_t{64} << 20;
constexpr size_t kAlign = 64;

std::atomic<size_t> g_live_bytes{0};

// Address ranges of the mapped chunks, for weight_arena_pages.
std::mutex g_chunks_mu;
std::vector<std::pair<uintptr_t, uintptr_t>> g_chunks;

bool huge_pages_wanted() {
  static const bool wanted = [] {
    const char* env = std::getenv("MLXCEL_HUGE_PAGES");
    return !(env && std::string(env) == "0");
  }();
  return wanted;
}

// One mapping, 2 MiB aligned; slices are carved from it front to back and
// it is unmapped when the last of them lets go.
class Chunk {
 public:
  explicit Chunk(size_t bytes) : bytes_(bytes) {
    // Map 2 MiB more and trim both ends, so the chunk starts on a huge page.
    const size_t mapped = bytes + kHugePage;
    void* raw = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) throw std::bad_alloc();
    const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t aligned = (start + kHugePage - 1) / kHugePage * kHugePage;
    if (aligned > start) munmap(raw, aligned - start);
    const uintptr_t end = start + mapped, used_end = aligned + bytes;
    if (end > used_end) munmap(reinterpret_cast<void*>(used_end), end - used_end);
    base_ = reinterpret_cast<uint8_t*>(aligned);
    {
      std::lock_guard<std::mutex> lock(g_chunks_mu);
      g_chunks.emplace_back(aligned, aligned + bytes);
    }
#ifdef MADV_HUGEPAGE
    // Before the first touch, so the faults themselves map huge pages.
    if (huge_pages_wanted()) madvise(base_, bytes_, MADV_HUGEPAGE);
#endif
  }
  ~Chunk() {
    {
      std::lock_guard<std::mutex> lock(g_chunks_mu);
      const auto range = std::make_pair(reinterpret_cast<uintptr_t>(base_), reinterpret_cast<uintptr_t>(base_) + bytes_);
      g_chunks.erase(std::remove(g_chunks.begin(), g_chunks.end(), range), g_chunks.end());
    }
    munmap(base_, bytes_);
  }
  Chunk(const Chunk&) = delete;
  Chunk& operator=(const Chunk&) = delete;

  uint8_t* base() const { return base_; }
  size_t bytes() const { return bytes_; }

 private:
  uint8_t* base_ = nullptr;
  size_t bytes_ = 0;
};

struct Arena {
  std::mutex mu;
  // The chunk being filled; weak, so that a chunk whose slices are all
  // freed is unmapped even while it is the current one.
  std::weak_ptr<Chunk> current;
  size_t used = 0;
};

Arena& arena() {
  static Arena* a = new Arena();  // never destroyed: slices may outlive statics
  return *a;
}

size_t page_bytes() {
  static const size_t page = (size_t)sysconf(_SC_PAGESIZE);
  return page;
}

// Hands the pages wholly inside [data, data + bytes) back to the system.
void release_pages(uint8_t* data, size_t bytes) {
  const size_t page = page_bytes();
  const uintptr_t start = reinterpret_cast<uintptr_t>(data), end = start + bytes;
  const uintptr_t first = (start + page - 1) / page * page, last = end / page * page;
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}

}  // namespace

namespace detail {

ArenaSlice arena_allocate(size_t bytes) {
  const size_t rounded = (std::max<size_t>(bytes, 1) + kAlign - 1) / kAlign * kAlign;
  Arena& a = arena();
  std::lock_guard<std::mutex> lock(a.mu);
  std::shared_ptr<Chunk> chunk;
  uint8_t* data = nullptr;
  if (rounded > kChunkBytes) {
    // A slice larger than a chunk gets a mapping of its own; the cursor stays.
    chunk = std::make_shared<Chunk>((rounded + kHugePage - 1) / kHugePage * kHugePage);
    data = chunk->base();
  } else {
    chunk = a.current.lock();
    if (!chunk || a.used + rounded > chunk->bytes()) {
      chunk = std::make_shared<Chunk>(kChunkBytes);
      a.current = chunk;
      a.used = 0;
    }
    data = chunk->base() + a.used;
    a.used += rounded;
  }
  g_live_bytes.fetch_add(rounded, std::memory_order_relaxed);
  // The slice's owner keeps the chunk. Releasing it returns the bytes to the
  // count and the pages wholly inside the slice to the system: the cursor
  // never comes back to them, and a weight replaced at load (converted,
  // quantized, skipped) would otherwise stay resident with its chunk.
  std::shared_ptr<void> owner(data, [chunk, rounded](void* at) {
    g_live_bytes.fetch_sub(rounded, std::memory_order_relaxed);
    release_pages(static_cast<uint8_t*>(at), rounded);
  });
  return ArenaSlice{data, std::move(owner)};
}

mx::array array_over(uint8_t* data, size_t bytes, size_t header_room, const mx::Shape& shape, mx::Dtype dtype,
                     std::function<void()> release, const char* caller) {
  // An MLX buffer points at the allocator's header, `header` bytes before the data.
  char probe[64];
  const ptrdiff_t header = static_cast<char*>(mx::allocator::Buffer(probe).raw_ptr()) - probe;
  if (header < 0 || (size_t)header > header_room || (header >= (ptrdiff_t)sizeof(size_t) && header_room < sizeof(size_t))) {
    throw std::runtime_error(std::string("[") + caller + "] unexpected MLX buffer layout");
  }
  uint8_t* buffer = data - header;
  if (header >= (ptrdiff_t)sizeof(size_t)) std::memcpy(buffer, &bytes, sizeof(size_t));
  mx::allocator::Data owned(mx::allocator::Buffer(buffer),
                            [release = std::move(release)](mx::allocator::Buffer) { release(); });
  mx::array out(std::move(owned), shape, dtype);
  if (out.data<void>() != data) throw std::runtime_error(std::string("[") + caller + "] MLX did not take the memory as it is");
  return out;
}

}  // namespace detail

mx::array weight_array(const void* data, size_t bytes, const mx::Shape& shape, mx::Dtype dtype) {
  size_t expected = dtype.size();
  for (int d : shape) {
    if (d < 0) throw std::invalid_argument("[mlxcel::kernels::weight_array] negative dimension in shape");
    expected *= (size_t)d;
  }
  if (expected != bytes) {
    throw std::invalid_argument("[mlxcel::kernels::weight_array] " + std::to_string(bytes) +
                                " bytes do not fill the shape's " + std::to_string(expected));
  }
  // The data starts on a 64-byte line, after room for MLX's buffer header.
  detail::ArenaSlice slice = detail::arena_allocate(kAlign + bytes);
  uint8_t* payload = slice.data + kAlign;
  if (bytes) std::memcpy(payload, data, bytes);
  return detail::array_over(payload, bytes, kAlign, shape, dtype, [owner = std::move(slice.owner)] {},
                            "mlxcel::kernels::weight_array");
}

size_t weight_arena_bytes() { return g_live_bytes.load(std::memory_order_relaxed); }

ArenaPages weight_arena_pages() {
  ArenaPages pages;
  std::vector<std::pair<uintptr_t, uintptr_t>> chunks;
  {
    std::lock_guard<std::mutex> lock(g_chunks_mu);
    chunks = g_chunks;
  }
  FILE* f = chunks.empty() ? nullptr : std::fopen("/proc/self/smaps", "r");
  if (!f) return pages;
  // A mapping's header line ("start-end perms ...") and then its fields;
  // a field counts when the mapping lies inside a chunk.
  char line[512];
  bool inside = false;
  size_t size_kb = 0;
  while (std::fgets(line, sizeof(line), f)) {
    unsigned long start = 0, end = 0;
    char dash = 0;
    if (std::sscanf(line, "%lx%c%lx", &start, &dash, &end) == 3 && dash == '-') {
      inside = std::any_of(chunks.begin(), chunks.end(), [&](const auto& c) { return start >= c.first && end <= c.second; });
      size_kb = (size_t)(end - start) / 1024;
      continue;
    }
    if (!inside) continue;
    size_t kb = 0;
    if (std::sscanf(line, "AnonHugePages: %zu kB", &kb) == 1) pages.huge += kb * 1024;
    if (std::sscanf(line, "Rss: %zu kB", &kb) == 1) pages.resident += kb * 1024;
    if (std::sscanf(line, "THPeligible: %zu", &kb) == 1 && kb == 1) pages.eligible += size_kb * 1024;
  }
  std::fclose(f);
  return pages;
}

bool weight_arena_huge_pages() {
#ifdef MADV_HUGEPAGE
  if (!huge_pages_wanted()) return false;
  static const bool available = [] {
    char mode[128] = {};
    FILE* f = std::fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
    if (!f) return false;
    const size_t n = std::fread(mode, 1, sizeof(mode) - 1, f);
    std::fclose(f);
    mode[n] = 0;
    return std::strstr(mode, "[never]") == nullptr;
  }();
  return available;
#else
  return false;
#endif
}

}  // namespace mlxcel::kernels

// AlignedBuffer: a 64-byte aligned scratch buffer, the CPU kernels' reusable workspace
// (moe_experts.cc, linear.cc, decoder_step.cc). It keeps its memory between calls, so a warm call
// allocates nothing, and is released by release_if_large() at the end of a call that left it above
// the retain limit (moespec/scratch.h); release_if_large(...) applies the rule to several buffers
// and to the kernels' vector scratch.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <vector>

namespace moespec {
namespace cpu {

extern std::atomic<std::size_t> g_scratch_held;  // bytes every AlignedBuffer holds (scratch_bytes())
std::size_t scratch_retain_limit();              // bytes per buffer kept after a call

class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer() { release(); }

  // At least `bytes` bytes (at least 64), valid until the next get() that grows it or a release.
  void* get(std::size_t bytes) {
    if (bytes > capacity_ || data_ == nullptr) {
      const std::size_t cap = (std::max({bytes, capacity_ + capacity_ / 2, std::size_t{64}}) + 63) / 64 * 64;
      release();
      void* p = std::aligned_alloc(64, cap);
      if (p == nullptr) throw std::bad_alloc();
      data_.reset(p);
      capacity_ = cap;
      g_scratch_held.fetch_add(cap, std::memory_order_relaxed);
    }
    return data_.get();
  }
  // `n` elements of T.
  template <typename T>
  T* get(int64_t n) {
    return static_cast<T*>(get(static_cast<std::size_t>(std::max<int64_t>(n, 1)) * sizeof(T)));
  }

  // Frees the memory when it is above the retain limit (call when the buffer's data is done with).
  void release_if_large() {
    if (capacity_ > scratch_retain_limit()) release();
  }

 private:
  void release() {
    if (data_ == nullptr) return;
    data_.reset();
    g_scratch_held.fetch_sub(capacity_, std::memory_order_relaxed);
    capacity_ = 0;
  }
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  std::unique_ptr<void, Free> data_;
  std::size_t capacity_ = 0;
};

inline void release_one_if_large(AlignedBuffer& b) { b.release_if_large(); }
template <typename T>
void release_one_if_large(std::vector<T>& v) {
  if (v.capacity() * sizeof(T) > scratch_retain_limit()) std::vector<T>().swap(v);
}

// Each buffer or vector above the retain limit freed (call when their data is done with).
template <typename... Buffers>
void release_if_large(Buffers&... buffers) {
  (release_one_if_large(buffers), ...);
}

}  // namespace cpu
}  // namespace moespec

// AlignedBuffer: a grow-only, 64-byte aligned scratch buffer, the CPU kernels' reusable workspace
// (moe_experts.cc, linear.cc, decoder_step.cc). It never shrinks, so a warm call allocates nothing.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>

namespace moespec {
namespace cpu {

class AlignedBuffer {
 public:
  // At least `bytes` bytes (at least 64), valid until the next get() that grows it.
  void* get(std::size_t bytes) {
    if (bytes > capacity_ || data_ == nullptr) {
      const std::size_t cap = (std::max({bytes, capacity_ + capacity_ / 2, std::size_t{64}}) + 63) / 64 * 64;
      void* p = std::aligned_alloc(64, cap);
      if (p == nullptr) throw std::bad_alloc();
      data_.reset(p);
      capacity_ = cap;
    }
    return data_.get();
  }
  // `n` elements of T.
  template <typename T>
  T* get(int64_t n) {
    return static_cast<T*>(get(static_cast<std::size_t>(std::max<int64_t>(n, 1)) * sizeof(T)));
  }

 private:
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  std::unique_ptr<void, Free> data_;
  std::size_t capacity_ = 0;
};

}  // namespace cpu
}  // namespace moespec

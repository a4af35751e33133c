// Unit tests of linear (cpp/src/linear.cc) and of the NN accumulation the native decoder step's
// attention uses (moe_experts_simd.h accumulate_*): every ISA the machine runs against a naive
// double-precision loop written here; batch invariance (a row alone gives the same bits as in a
// batch) and thread-count independence; bias in both dtypes; argument errors. Parity with
// torch.nn.functional.linear is tested in Python (tests/python/test_linear.py).
//
// Sizes are awkward on purpose (K and N odd, not multiples of any vector width; T in 1, 3, 17, 40:
// every branch of the product's schedule). Seeds are fixed so that a failure reproduces.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "check.h"
#include "moe_experts_simd.h"
#include "moespec/cpu_isa.h"
#include "moespec/detail/route_math.h"
#include "moespec/error.h"
#include "moespec/linear.h"
#include "moespec/route_experts.h"  // cuda::available
#include "moespec/thread_pool.h"

using namespace moespec;
using detail::bf16_to_float;
using detail::float_to_bf16;

namespace {

struct LinearCase {
  int64_t T, K, N;
  DType dtype;
  int bias;  // 0 none, 1 bias in x's dtype, 2 float32 bias
  std::vector<float> x, w, b;
  std::vector<uint16_t> x16, w16, b16, out16;
  std::vector<float> out;

  LinearCase(int64_t t, int64_t k, int64_t n, DType dt, int with_bias, uint32_t seed)
      : T(t), K(k), N(n), dtype(dt), bias(with_bias) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    x.resize(T * K);
    w.resize(N * K);
    b.resize(N);
    for (float& v : x) v = round(normal(rng));
    for (float& v : w) v = round(normal(rng) / std::sqrt(static_cast<float>(K)));
    for (float& v : b) v = bias == 1 ? round(normal(rng)) : normal(rng);
  }
  float round(float v) const { return dtype == DType::kBFloat16 ? bf16_to_float(float_to_bf16(v)) : v; }

  LinearArgs args() {
    LinearArgs a;
    if (dtype == DType::kBFloat16) {
      x16.resize(x.size());
      w16.resize(w.size());
      b16.resize(b.size());
      for (std::size_t i = 0; i < x.size(); ++i) x16[i] = float_to_bf16(x[i]);
      for (std::size_t i = 0; i < w.size(); ++i) w16[i] = float_to_bf16(w[i]);
      for (std::size_t i = 0; i < b.size(); ++i) b16[i] = float_to_bf16(b[i]);
      out16.assign(T * N, 0xffff);  // NaN: every element must be written
      a.x = TensorView::contiguous(x16.data(), dtype, {T, K});
      a.weight = TensorView::contiguous(w16.data(), dtype, {N, K});
      a.out = TensorView::contiguous(out16.data(), dtype, {T, N});
      if (bias == 1) a.bias = TensorView::contiguous(b16.data(), dtype, {N});
    } else {
      out.assign(T * N, std::numeric_limits<float>::quiet_NaN());
      a.x = TensorView::contiguous(x.data(), dtype, {T, K});
      a.weight = TensorView::contiguous(w.data(), dtype, {N, K});
      a.out = TensorView::contiguous(out.data(), dtype, {T, N});
      if (bias == 1) a.bias = TensorView::contiguous(b.data(), dtype, {N});
    }
    if (bias == 2) a.bias = TensorView::contiguous(b.data(), DType::kFloat32, {N});
    return a;
  }

  std::vector<float> run() {
    cpu::linear(args());
    if (dtype == DType::kFloat32) return out;
    std::vector<float> r(out16.size());
    for (std::size_t i = 0; i < r.size(); ++i) r[i] = bf16_to_float(out16[i]);
    return r;
  }

  std::vector<double> reference() const {
    std::vector<double> r(T * N);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t n = 0; n < N; ++n) {
        double s = bias ? b[n] : 0.0;
        for (int64_t k = 0; k < K; ++k) s += static_cast<double>(x[t * K + k]) * w[n * K + k];
        r[t * N + n] = s;
      }
    return r;
  }
};

// |got - want| <= tol * max|want| (+ one bf16 ulp of the value for bf16 outputs).
bool close(const std::vector<float>& got, const std::vector<double>& want, double tol, bool bf16, std::string* why) {
  double scale = 0.0;
  for (double v : want) scale = std::max(scale, std::abs(v));
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double allowed = tol * scale + (bf16 ? std::abs(want[i]) / 128.0 : 0.0);
    if (!(std::abs(got[i] - want[i]) <= allowed)) {
      *why = "element " + std::to_string(i) + ": got " + std::to_string(got[i]) + ", want " + std::to_string(want[i]);
      return false;
    }
  }
  return true;
}

// The same views, labelled as on CUDA device 0 (argument checks only).
LinearArgs on_cuda(LinearArgs a) {
  for (TensorView* t : {&a.x, &a.weight, &a.bias, &a.out})
    if (t->defined()) t->device = Device::kCUDA, t->device_index = 0;
  return a;
}

struct IsaGuard {  // restores the active ISA
  CpuIsa saved = active_cpu_isa();
  ~IsaGuard() { set_active_cpu_isa(saved); }
};

}  // namespace

TEST(linear_matches_the_naive_loop_on_every_isa) {
  IsaGuard guard;
  for (CpuIsa isa : supported_cpu_isas()) {
    set_active_cpu_isa(isa);
    for (DType dt : {DType::kFloat32, DType::kBFloat16})
      for (int64_t T : {1, 3, 17, 40})
        for (int bias : {0, 1, 2}) {
          LinearCase c(T, 77, 45, dt, bias, static_cast<uint32_t>(T * 10 + bias));
          std::string why;
          const bool bf16 = dt == DType::kBFloat16;
          CHECK_MSG(close(c.run(), c.reference(), bf16 ? 4e-3 : 1e-5, bf16, &why),
                    std::string(cpu_isa_name(isa)) + " T=" + std::to_string(T) + ": " + why);
        }
  }
}

TEST(linear_rows_do_not_depend_on_the_batch_or_the_threads) {
  IsaGuard guard;
  ThreadPool& pool = ThreadPool::instance();
  const int threads = pool.num_threads();
  for (CpuIsa isa : supported_cpu_isas()) {
    set_active_cpu_isa(isa);
    for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
      LinearCase batch(40, 301, 203, dt, 1, 7);  // wide enough for the thread pool's tiles
      const std::vector<float> all = batch.run();
      for (int64_t t : {0, 5, 39}) {
        LinearCase one(1, 301, 203, dt, 1, 7);
        one.w = batch.w;
        one.b = batch.b;
        std::copy(batch.x.begin() + t * 301, batch.x.begin() + (t + 1) * 301, one.x.begin());
        const std::vector<float> row = one.run();
        CHECK_MSG(std::memcmp(row.data(), all.data() + t * 203, 203 * sizeof(float)) == 0,
                  std::string(cpu_isa_name(isa)) + ": row " + std::to_string(t) + " differs alone");
      }
      pool.set_num_threads(1);
      const std::vector<float> serial = batch.run();
      pool.set_num_threads(threads);
      CHECK_MSG(serial == all, std::string(cpu_isa_name(isa)) + ": 1 thread differs");
    }
  }
}

TEST(accumulate_nn_matches_the_naive_loop_on_every_isa) {
  for (CpuIsa isa : supported_cpu_isas()) {
    const cpu::MoeExpertKernels& k = cpu::moe_expert_kernels(isa);
    for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
      for (int64_t N : {1, 7, 64, 77}) {
        const int64_t S = 29, n_tok = 5;
        std::mt19937 rng(static_cast<uint32_t>(N));
        std::normal_distribution<float> normal(0.0f, 1.0f);
        std::vector<float> w(S * N), a(n_tok * S), c(n_tok * N), c0(n_tok * N);
        std::vector<uint16_t> w16(S * N);
        for (std::size_t i = 0; i < w.size(); ++i) {
          w16[i] = float_to_bf16(normal(rng));
          w[i] = dt == DType::kBFloat16 ? bf16_to_float(w16[i]) : normal(rng);
        }
        for (float& v : a) v = normal(rng);
        for (float& v : c0) v = normal(rng);
        c = c0;
        auto accumulate = [&](const float* rows, int64_t n, float* out) {  // S rows of w, n activation rows
          (dt == DType::kBFloat16 ? k.accumulate_bf16 : k.accumulate_f32)(
              dt == DType::kBFloat16 ? static_cast<const void*>(w16.data()) : w.data(), N, S, N, rows, S, n, out, N);
        };
        accumulate(a.data(), n_tok, c.data());
        double scale = 0.0;
        std::vector<double> want(n_tok * N);
        for (int64_t n = 0; n < n_tok; ++n)
          for (int64_t j = 0; j < N; ++j) {
            double s = c0[n * N + j];
            for (int64_t t = 0; t < S; ++t) s += static_cast<double>(a[n * S + t]) * w[t * N + j];
            want[n * N + j] = s;
            scale = std::max(scale, std::abs(s));
          }
        for (std::size_t i = 0; i < c.size(); ++i)
          CHECK_MSG(std::abs(c[i] - want[i]) <= 1e-5 * scale,
                    std::string(k.name) + " N=" + std::to_string(N) + ": element " + std::to_string(i));
        // one row alone gives the same bits as in the block
        std::vector<float> single(c0.begin() + 3 * N, c0.begin() + 4 * N);
        accumulate(a.data() + 3 * S, 1, single.data());
        CHECK_MSG(std::memcmp(single.data(), c.data() + 3 * N, N * sizeof(float)) == 0,
                  std::string(k.name) + ": a row alone differs");
      }
    }
  }
}

TEST(linear_rejects_bad_arguments) {
  LinearCase c(3, 16, 8, DType::kFloat32, 0, 1);
  LinearArgs a = c.args();
  LinearArgs bad = a;
  bad.weight = TensorView::contiguous(c.w.data(), DType::kFloat32, {4, 32});
  CHECK_THROWS_WITH(cpu::linear(bad), "weight");
  bad = a;
  bad.weight.dtype = DType::kBFloat16;
  CHECK_THROWS_WITH(cpu::linear(bad), "x's dtype");
  bad = a;
  bad.bias = TensorView::contiguous(c.b.data(), DType::kFloat32, {7});
  CHECK_THROWS_WITH(cpu::linear(bad), "bias");
  bad = a;
  bad.out = TensorView::contiguous(c.out.data(), DType::kFloat32, {3, 7});
  CHECK_THROWS_WITH(cpu::linear(bad), "out");
  bad = a;
  bad.x.device = Device::kCUDA;  // every tensor on x's device
  CHECK_THROWS_WITH(cpu::linear(bad), "weight: expected a tensor on cuda");
  bad = a;
  bad.x = TensorView{};
  CHECK_THROWS_WITH(cpu::linear(bad), "x");
  bad = on_cuda(a);
  CHECK_THROWS_WITH(cpu::linear(bad), "needs CPU tensors");
}

// The CUDA entry point's own conditions, checked before anything is launched (so the views may
// point at host memory: nothing reads them). Valid arguments are not run here: on a machine with a
// GPU they would launch on host pointers (tests/gpu/test_linear_cuda.py runs the kernel).
TEST(cuda_linear_rejects_what_its_kernel_does_not_take) {
  if (!cuda::available()) return;  // (a build without CUDA: cuda::linear only says so)
  LinearCase f32(3, 64, 8, DType::kFloat32, 0, 2);
  CHECK_THROWS_WITH(cuda::linear(on_cuda(f32.args()), nullptr), "bfloat16");
  LinearCase odd(3, 48, 8, DType::kBFloat16, 0, 3);
  CHECK_THROWS_WITH(cuda::linear(on_cuda(odd.args()), nullptr), "a multiple of 32");
  LinearCase bf(3, 64, 8, DType::kBFloat16, 2, 4);
  LinearArgs a = on_cuda(bf.args());
  a.x.data = static_cast<char*>(a.x.data) + 2;  // (the view's extent stays inside the buffer's first rows)
  a.x.shape[0] = 1;
  a.out.shape[0] = 1;
  CHECK_THROWS_WITH(cuda::linear(a, nullptr), "16-byte aligned");
  a = on_cuda(bf.args());
  a.bias.device = Device::kCPU;
  CHECK_THROWS_WITH(cuda::linear(a, nullptr), "bias: expected a tensor on cuda");
}

TEST(exp_sum_matches_expf_on_every_isa) {
  for (CpuIsa isa : supported_cpu_isas()) {
    const cpu::MoeExpertKernels& k = cpu::moe_expert_kernels(isa);
    for (int64_t n : {1, 7, 8, 29, 130}) {
      std::vector<float> x(static_cast<std::size_t>(n));
      for (int64_t i = 0; i < n; ++i) x[i] = i % 5 == 3 ? -std::numeric_limits<float>::infinity() : -0.37f * i + 3.0f;
      std::vector<float> y = x;
      const float sum = k.exp_sum(y.data(), n, 3.0f);
      double want_sum = 0.0;
      for (int64_t i = 0; i < n; ++i) {
        const double want = std::isinf(x[i]) ? 0.0 : std::exp(static_cast<double>(x[i]) - 3.0);
        want_sum += want;
        CHECK_MSG(std::abs(y[i] - want) <= 3e-7 * want + (want == 0.0 ? 0.0 : 1e-38),
                  std::string(k.name) + ": exp at " + std::to_string(i));
        if (std::isinf(x[i])) CHECK(y[i] == 0.0f);
      }
      CHECK_MSG(std::abs(sum - want_sum) <= 1e-6 * want_sum, std::string(k.name) + ": sum");
      // zeros (masked slots) anywhere leave the sum's bits unchanged: it is taken in index order
      std::vector<float> packed;
      for (int64_t i = 0; i < n; ++i)
        if (!std::isinf(x[i])) packed.push_back(x[i]);
      CHECK(k.exp_sum(packed.data(), static_cast<int64_t>(packed.size()), 3.0f) == sum);
    }
  }
}

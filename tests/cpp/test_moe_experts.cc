// Unit tests of moe_experts (cpp/src/moe_experts*.cc): the scalar path against a naive
// double-precision triple loop written here, every ISA table the machine runs against the scalar
// path, routing corner cases (dropped and zero-weight slots, unused experts, fully dropped
// tokens), bit-identical results for any thread count, and the argument errors. Parity with the
// plain-torch reference is tested in Python (tests/python/test_moe_experts.py).
//
// Sizes are awkward on purpose: H and I odd and not multiples of any vector width, T in
// {0, 1, 3, 17, 64, 130}. Seeds are fixed so that a failure reproduces.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
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
#include "moespec/moe_experts.h"
#include "moespec/scratch.h"
#include "moespec/thread_pool.h"

using namespace moespec;
using detail::bf16_to_float;
using detail::float_to_bf16;

namespace {

// Dimensions: T tokens, H hidden, I intermediate, E experts, K top-k.
struct Shape {
  int64_t T, H, I, E, K;
};

// Owns the buffers of one moe_experts call. Values are stored as float; for bf16 they are rounded
// to bf16 first, so `x`, `experts` hold exactly what the kernel sees.
struct Case {
  Shape s;
  DType dtype;
  ExpertActivation activation;
  bool with_biases;
  std::vector<float> x, experts, biases, weights;
  std::vector<int32_t> ids;
  std::vector<uint16_t> x16, experts16, out16;
  std::vector<float> out;
  float limit = 7.0f, alpha = 1.702f;

  Case(Shape shape, DType dt, ExpertActivation act, bool biases_, uint32_t seed)
      : s(shape), dtype(dt), activation(act), with_biases(biases_) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const float w_scale = 1.0f / std::sqrt(static_cast<float>(s.H));
    x.resize(s.T * s.H);
    for (float& v : x) v = round(normal(rng));
    experts.resize(s.E * 3 * s.I * s.H);
    for (float& v : experts) v = round(3.0f * w_scale * normal(rng));
    if (with_biases) {
      biases.resize(s.E * (2 * s.I + s.H));
      for (float& v : biases) v = 0.5f * normal(rng);
    }
    // Routing: distinct experts per token, about one slot in six dropped, some zero weights.
    ids.resize(s.T * s.K);
    weights.resize(s.T * s.K);
    std::uniform_int_distribution<int> pick(0, static_cast<int>(s.E) - 1);
    std::uniform_real_distribution<float> unit(0.0f, 1.0f);
    for (int64_t t = 0; t < s.T; ++t) {
      for (int64_t k = 0; k < s.K; ++k) {
        int32_t e;
        bool fresh;
        do {
          e = pick(rng);
          fresh = true;
          for (int64_t j = 0; j < k; ++j) fresh &= ids[t * s.K + j] != e;
        } while (!fresh && s.K <= s.E);
        const float u = unit(rng);
        ids[t * s.K + k] = u < 0.16f ? static_cast<int32_t>(s.E) : e;
        weights[t * s.K + k] = u < 0.16f ? 0.0f : (u > 0.95f ? 0.0f : unit(rng));
      }
    }
  }

  float round(float v) const { return dtype == DType::kBFloat16 ? bf16_to_float(float_to_bf16(v)) : v; }

  MoeExpertsArgs args() {
    MoeExpertsArgs a;
    const int64_t T = s.T, H = s.H, I = s.I, E = s.E, K = s.K;
    if (dtype == DType::kBFloat16) {
      x16.resize(x.size());
      experts16.resize(experts.size());
      for (std::size_t i = 0; i < x.size(); ++i) x16[i] = float_to_bf16(x[i]);
      for (std::size_t i = 0; i < experts.size(); ++i) experts16[i] = float_to_bf16(experts[i]);
      out16.assign(T * H, 0xffff);  // NaN: every element must be written
      a.x = TensorView::contiguous(x16.data(), dtype, {T, H});
      a.experts = TensorView::contiguous(experts16.data(), dtype, {E, 3 * I * H});
      a.out = TensorView::contiguous(out16.data(), dtype, {T, H});
    } else {
      out.assign(T * H, std::numeric_limits<float>::quiet_NaN());
      a.x = TensorView::contiguous(x.data(), dtype, {T, H});
      a.experts = TensorView::contiguous(experts.data(), dtype, {E, 3 * I * H});
      a.out = TensorView::contiguous(out.data(), dtype, {T, H});
    }
    a.ids = TensorView::contiguous(ids.data(), DType::kInt32, {T, K});
    a.weights = TensorView::contiguous(weights.data(), DType::kFloat32, {T, K});
    if (with_biases) a.biases = TensorView::contiguous(biases.data(), DType::kFloat32, {E, 2 * I + H});
    a.intermediate_size = I;
    a.activation = activation;
    a.limit = limit;
    a.alpha = alpha;
    return a;
  }

  // The output as floats.
  std::vector<float> result() const {
    if (dtype == DType::kFloat32) return out;
    std::vector<float> r(out16.size());
    for (std::size_t i = 0; i < r.size(); ++i) r[i] = bf16_to_float(out16[i]);
    return r;
  }

  std::vector<float> run(const cpu::MoeExpertKernels& kernels) {
    cpu::moe_experts_with(args(), kernels);
    return result();
  }

  // Naive triple loop in double: the header's semantics, slot by slot.
  std::vector<float> reference() const {
    const int64_t T = s.T, H = s.H, I = s.I, E = s.E, K = s.K;
    std::vector<double> acc(T * H, 0.0);
    std::vector<double> h(I);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t k = 0; k < K; ++k) {
        const int32_t e = ids[t * K + k];
        const double w = weights[t * K + k];
        if (e == E || w == 0.0) continue;
        const float* gate = experts.data() + e * 3 * I * H;
        const float* up = gate + I * H;
        const float* down = up + I * H;
        const float* b = with_biases ? biases.data() + e * (2 * I + H) : nullptr;
        for (int64_t j = 0; j < I; ++j) {
          double g = 0.0, u = 0.0;
          for (int64_t c = 0; c < H; ++c) {
            g += static_cast<double>(gate[j * H + c]) * x[t * H + c];
            u += static_cast<double>(up[j * H + c]) * x[t * H + c];
          }
          if (b) g += b[j], u += b[I + j];
          double hv;
          if (activation == ExpertActivation::kSwiGLU) {
            hv = g / (1.0 + std::exp(-g)) * u;
          } else {
            g = std::min<double>(g, limit);
            u = std::max<double>(-limit, std::min<double>(u, limit));
            hv = (u + 1.0) * g / (1.0 + std::exp(-alpha * g));
          }
          h[j] = round(static_cast<float>(hv));
        }
        for (int64_t c = 0; c < H; ++c) {
          double y = 0.0;
          for (int64_t j = 0; j < I; ++j) y += static_cast<double>(down[c * I + j]) * h[j];
          if (b) y += b[2 * I + c];
          acc[t * H + c] += w * y;
        }
      }
    }
    std::vector<float> r(acc.size());
    for (std::size_t i = 0; i < r.size(); ++i) r[i] = round(static_cast<float>(acc[i]));
    return r;
  }
};

// One bf16 ulp of |v| (the spacing of bf16 values at v).
float bf16_ulp(float v) {
  int e;
  std::frexp(std::max(std::fabs(v), 1e-30f), &e);
  return std::ldexp(1.0f, e - 8);
}

// |a - b| <= rel * max|ref| for fp32; for bf16 the bound adds one bf16 ulp of the value, because
// two sums that differ in the last fp32 bits may round to neighbouring bf16 values.
bool close(const std::vector<float>& got, const std::vector<float>& ref, DType dtype, double rel, std::string& why) {
  if (got.size() != ref.size()) {
    why = "size differs";
    return false;
  }
  float scale = 0.0f;
  for (float v : ref) scale = std::max(scale, std::fabs(v));
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double bound = rel * scale + (dtype == DType::kBFloat16 ? bf16_ulp(ref[i]) : 0.0);
    if (!(std::fabs(static_cast<double>(got[i]) - ref[i]) <= bound)) {
      why = "element " + std::to_string(i) + ": got " + std::to_string(got[i]) + ", expected " +
            std::to_string(ref[i]) + " (scale " + std::to_string(scale) + ")";
      return false;
    }
  }
  return true;
}

double tolerance(DType dtype) { return dtype == DType::kBFloat16 ? 4e-3 : 1e-5; }

std::string label(const Case& c, const char* what) {
  return std::string(what) + " dtype=" + dtype_name(c.dtype) + " act=" + std::to_string(static_cast<int>(c.activation)) +
         " biases=" + std::to_string(c.with_biases) + " T=" + std::to_string(c.s.T) + " H=" + std::to_string(c.s.H) +
         " I=" + std::to_string(c.s.I);
}

// Every table this machine can run: scalar, avx2, avx512 (and its AVX512_BF16 variant).
std::vector<const cpu::MoeExpertKernels*> runnable_tables() {
  std::vector<const cpu::MoeExpertKernels*> tables{&cpu::scalar::kMoeExperts};
  for (CpuIsa isa : supported_cpu_isas()) {
#if defined(MOESPEC_HAVE_AVX2)
    if (isa == CpuIsa::kAvx2) tables.push_back(&cpu::avx2::kMoeExperts);
#endif
#if defined(MOESPEC_HAVE_AVX512)
    if (isa == CpuIsa::kAvx512) {
      tables.push_back(&cpu::avx512::kMoeExperts);
      if (cpu_has_avx512_bf16()) tables.push_back(&cpu::avx512::kMoeExpertsBf16);
    }
#endif
  }
  return tables;
}

struct Variant {
  DType dtype;
  ExpertActivation activation;
  bool biases;
};
const Variant kVariants[] = {
    {DType::kFloat32, ExpertActivation::kSwiGLU, false}, {DType::kBFloat16, ExpertActivation::kSwiGLU, false},
    {DType::kFloat32, ExpertActivation::kGptOss, true},  {DType::kBFloat16, ExpertActivation::kGptOss, true},
    {DType::kFloat32, ExpertActivation::kGptOss, false}, {DType::kBFloat16, ExpertActivation::kGptOss, false},
};

struct KeepThreads {
  int saved = ThreadPool::instance().num_threads();
  ~KeepThreads() { ThreadPool::instance().set_num_threads(saved); }
};

}  // namespace

TEST(scalar_matches_naive_double_reference) {
  uint32_t seed = 1;
  for (const Variant& v : kVariants) {
    for (int64_t T : {0, 1, 3, 17, 64, 130}) {
      Case c({T, 45, 37, 7, 3}, v.dtype, v.activation, v.biases, seed++);
      std::string why;
      CHECK_MSG(close(c.run(cpu::scalar::kMoeExperts), c.reference(), v.dtype, tolerance(v.dtype), why),
                label(c, "scalar vs naive:") + ": " + why);
    }
  }
}

TEST(every_isa_activation_matches_a_double_reference) {
  // The activation entry alone, every length 1..40 (the SIMD tails) and values reaching past the
  // polynomial exp's range and GPT-OSS's clamp, in place (h aliases g) as moe_experts calls it.
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> wide(-120.0f, 120.0f), near(-9.0f, 9.0f);
  const float limit = 7.0f, alpha = 1.702f;
  for (const cpu::MoeExpertKernels* table : runnable_tables()) {
    for (ExpertActivation act : {ExpertActivation::kSwiGLU, ExpertActivation::kGptOss}) {
      for (int64_t n = 1; n <= 40; ++n) {
        std::vector<float> g(static_cast<std::size_t>(n)), u(g.size());
        for (int64_t j = 0; j < n; ++j) {
          g[j] = j % 5 == 0 ? wide(rng) : near(rng);
          u[j] = j % 7 == 0 ? wide(rng) : near(rng);
        }
        std::vector<double> want(g.size());
        for (int64_t j = 0; j < n; ++j) {
          double gv = g[j], uv = u[j];
          if (act == ExpertActivation::kSwiGLU) {
            want[j] = gv / (1.0 + std::exp(-gv)) * uv;
          } else {
            gv = std::min(gv, double{limit});
            uv = std::max(std::min(uv, double{limit}), -double{limit});
            want[j] = (uv + 1.0) * gv / (1.0 + std::exp(-alpha * gv));
          }
        }
        table->activate(act, limit, alpha, g.data(), u.data(), n, g.data());
        for (int64_t j = 0; j < n; ++j) {
          const double err = std::abs(g[j] - want[j]);
          CHECK_MSG(std::isfinite(g[j]) && err <= 1e-5 * std::abs(want[j]) + 1e-30,
                    std::string(table->name) + " n=" + std::to_string(n) + " j=" + std::to_string(j) + ": " +
                        std::to_string(g[j]) + " vs " + std::to_string(want[j]));
        }
      }
    }
  }
}

TEST(every_isa_matches_scalar) {
  // Two shapes: a small odd one, and one with several row and column tiles and full vectors.
  // A small odd shape; one with several row and column tiles, full vectors and tails; one whose
  // rows are whole numbers of vectors.
  const Shape shapes[] = {{0, 45, 37, 7, 3}, {0, 161, 75, 9, 4}, {0, 64, 48, 4, 2}};
  uint32_t seed = 100;
  for (const cpu::MoeExpertKernels* table : runnable_tables()) {
    for (const Shape& base : shapes) {
      for (const Variant& v : kVariants) {
        for (int64_t T : {1, 3, 17, 64, 130}) {
          Shape s = base;
          s.T = T;
          Case c(s, v.dtype, v.activation, v.biases, seed++);
          const std::vector<float> ref = c.run(cpu::scalar::kMoeExperts);
          std::string why;
          CHECK_MSG(close(c.run(*table), ref, v.dtype, tolerance(v.dtype), why),
                    label(c, table->name) + ": " + why);
        }
      }
    }
  }
}

TEST(dispatch_follows_the_active_isa) {
  const CpuIsa saved = active_cpu_isa();
  for (CpuIsa isa : supported_cpu_isas()) {
    set_active_cpu_isa(isa);
    Case c({17, 45, 37, 7, 3}, DType::kBFloat16, ExpertActivation::kSwiGLU, false, 7);
    cpu::moe_experts(c.args());
    const std::vector<float> got = c.result();
    CHECK_MSG(got == c.run(cpu::moe_expert_kernels(isa)), cpu_isa_name(isa));
  }
  set_active_cpu_isa(saved);
}

TEST(routing_corner_cases) {
  for (const cpu::MoeExpertKernels* table : runnable_tables()) {
    for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
      Case c({5, 45, 37, 6, 3}, dtype, ExpertActivation::kSwiGLU, false, 11);
      // token 0: every slot dropped; token 1: every slot zero-weighted; token 2: expert 4 twice;
      // experts 1 and 5 used by no slot (their weights are NaN: reading them would show);
      // expert 3 used only with weight 0 (NaN too).
      const int32_t E = 6;
      c.ids = {E, E, E, /**/ 0, 3, 2, /**/ 4, 4, 0, /**/ 2, E, 0, /**/ 0, 2, 4};
      c.weights = {0, 0, 0, /**/ 0, 0, 0, /**/ 0.5f, 0.25f, 1, /**/ -1, 0, 2, /**/ 0.1f, 0.2f, 0.3f};
      const int64_t block = 3 * c.s.I * c.s.H;
      for (int e : {1, 3, 5})
        std::fill_n(c.experts.begin() + e * block, block, std::numeric_limits<float>::quiet_NaN());
      const std::vector<float> got = c.run(*table);
      bool rows_zero = true, finite = true;
      for (int64_t i = 0; i < 2 * c.s.H; ++i) rows_zero &= got[i] == 0.0f && !std::signbit(got[i]);
      for (float v : got) finite &= std::isfinite(v);
      CHECK_MSG(rows_zero, table->name);
      CHECK_MSG(finite, table->name);
      std::string why;
      CHECK_MSG(close(got, c.reference(), dtype, tolerance(dtype), why), std::string(table->name) + ": " + why);
    }
  }
}

TEST(all_slots_dropped_writes_zeros) {
  Case c({4, 33, 9, 3, 2}, DType::kBFloat16, ExpertActivation::kSwiGLU, false, 12);
  std::fill(c.ids.begin(), c.ids.end(), 3);
  const std::vector<float> got = c.run(cpu::moe_expert_kernels(active_cpu_isa()));
  CHECK(std::all_of(got.begin(), got.end(), [](float v) { return v == 0.0f; }));
}

TEST(zero_expert_weights_give_zero_output) {
  Case c({9, 45, 37, 5, 2}, DType::kFloat32, ExpertActivation::kSwiGLU, false, 13);
  std::fill(c.experts.begin(), c.experts.end(), 0.0f);
  for (const cpu::MoeExpertKernels* table : runnable_tables()) {
    const std::vector<float> got = c.run(*table);
    CHECK_MSG(std::all_of(got.begin(), got.end(), [](float v) { return v == 0.0f; }), table->name);
  }
}

TEST(strided_x_rows) {
  Case c({6, 45, 37, 5, 2}, DType::kFloat32, ExpertActivation::kSwiGLU, false, 14);
  const std::vector<float> ref = c.run(cpu::scalar::kMoeExperts);
  std::vector<float> wide(c.s.T * 64, std::numeric_limits<float>::quiet_NaN());
  for (int64_t t = 0; t < c.s.T; ++t) std::copy_n(c.x.begin() + t * c.s.H, c.s.H, wide.begin() + t * 64);
  MoeExpertsArgs a = c.args();
  a.x.data = wide.data();
  a.x.strides[0] = 64;
  for (const cpu::MoeExpertKernels* table : runnable_tables()) {
    cpu::moe_experts_with(a, *table);
    std::string why;
    CHECK_MSG(close(c.result(), ref, DType::kFloat32, 1e-5, why), why);
  }
}

// (T = 130: the tiled schedule; T = 40: the streaming one, whose row ranges follow the thread count.)
TEST(results_do_not_depend_on_the_thread_count) {
  KeepThreads keep;
  for (const Variant& v : kVariants) {
    for (int64_t T : {130, 40}) {
      Case c({T, 161, 75, 9, 4}, v.dtype, v.activation, v.biases, 21);
      for (const cpu::MoeExpertKernels* table : runnable_tables()) {
        ThreadPool::instance().set_num_threads(1);
        const std::vector<float> one = c.run(*table);
        for (int threads : {2, 3, 5}) {
          ThreadPool::instance().set_num_threads(threads);
          const std::vector<float> many = c.run(*table);
          CHECK_MSG(std::memcmp(one.data(), many.data(), one.size() * sizeof(float)) == 0,
                    label(c, table->name) + " threads=" + std::to_string(threads));
        }
      }
    }
  }
}

// A token's output depends on its own row only (x, ids, weights), never on the other tokens of
// the call: the same bits alone as in a batch of 130 (what makes a verify pass agree with decode).
TEST(results_do_not_depend_on_the_other_tokens) {
  for (const Variant& v : kVariants) {
    Case c({130, 161, 75, 9, 4}, v.dtype, v.activation, v.biases, 41);
    for (const cpu::MoeExpertKernels* table : runnable_tables()) {
      const std::vector<float> batch = c.run(*table);
      for (int64_t t : {0, 1, 64, 129}) {
        Case one = c;
        one.s.T = 1;
        one.x.assign(c.x.begin() + t * c.s.H, c.x.begin() + (t + 1) * c.s.H);
        one.ids.assign(c.ids.begin() + t * c.s.K, c.ids.begin() + (t + 1) * c.s.K);
        one.weights.assign(c.weights.begin() + t * c.s.K, c.weights.begin() + (t + 1) * c.s.K);
        const std::vector<float> alone = one.run(*table);
        CHECK_MSG(std::memcmp(alone.data(), batch.data() + t * c.s.H, alone.size() * sizeof(float)) == 0,
                  label(c, table->name) + " token " + std::to_string(t));
      }
    }
  }
}

// With a retain limit of 0 every call frees its scratch at the end (and the next one allocates it
// again): the same bits as with the scratch kept, and nothing held afterwards (under the sanitizer
// build, also no use of freed scratch).
TEST(scratch_released_after_every_call_gives_the_same_results) {
  for (const Variant& v : kVariants) {
    Case c({130, 161, 75, 9, 4}, v.dtype, v.activation, v.biases, 51);
    for (const cpu::MoeExpertKernels* table : runnable_tables()) {
      const std::vector<float> kept = c.run(*table);
      const std::size_t held = scratch_bytes();
      const std::size_t saved = set_scratch_retain_bytes(0);
      const std::vector<float> first = c.run(*table);
      const std::size_t after = scratch_bytes();
      const std::vector<float> second = c.run(*table);
      set_scratch_retain_bytes(saved);
      CHECK_MSG(std::memcmp(kept.data(), first.data(), kept.size() * sizeof(float)) == 0 &&
                    std::memcmp(kept.data(), second.data(), kept.size() * sizeof(float)) == 0,
                label(c, table->name));
      CHECK_MSG(after < held || held == 0, "held " + std::to_string(held) + " after " + std::to_string(after));
    }
  }
}

TEST(bad_arguments) {
  Case c({3, 45, 37, 5, 2}, DType::kFloat32, ExpertActivation::kSwiGLU, false, 31);
  Case b({3, 45, 37, 5, 2}, DType::kBFloat16, ExpertActivation::kSwiGLU, false, 31);
  auto run = [](const MoeExpertsArgs& a) { cpu::moe_experts(a); };
  MoeExpertsArgs a = c.args();

  a = c.args();
  a.x.dtype = DType::kFloat16;
  CHECK_THROWS_WITH(run(a), "x: expected dtype float32 or bfloat16");
  a = c.args();
  a.x = b.args().x;  // bf16 x with fp32 experts
  CHECK_THROWS_WITH(run(a), "x: x's dtype must equal experts' dtype float32");
  a = c.args();
  a.x.ndim = 1;
  CHECK_THROWS_WITH(run(a), "x: expected a 2-d tensor");
  a = c.args();
  a.x.strides[1] = 2;
  CHECK_THROWS_WITH(run(a), "x: expected rows of contiguous elements");
  a = c.args();
  a.ids.dtype = DType::kInt64;
  CHECK_THROWS_WITH(run(a), "ids: expected dtype int32");
  a = c.args();
  a.ids.shape[0] = 4;
  CHECK_THROWS_WITH(run(a), "ids: expected size 3 in dim 0");
  a = c.args();
  a.weights.shape[1] = 3;
  CHECK_THROWS_WITH(run(a), "weights: expected size 2 in dim 1");
  a = c.args();
  a.weights.dtype = DType::kBFloat16;
  CHECK_THROWS_WITH(run(a), "weights: expected dtype float32");
  a = c.args();
  a.experts.dtype = DType::kFloat16;
  CHECK_THROWS_WITH(run(a), "experts: expected dtype float32 or bfloat16");
  a = c.args();
  a.experts.ndim = 3;
  CHECK_THROWS_WITH(run(a), "experts: expected a 2-d tensor");
  a = c.args();
  a.intermediate_size = 36;
  CHECK_THROWS_WITH(run(a), "intermediate_size: experts' rows must hold 3 * I * H");
  a = c.args();
  a.intermediate_size = 0;
  CHECK_THROWS_WITH(run(a), "intermediate_size: must be >= 1");
  a = c.args();
  a.out.dtype = DType::kBFloat16;
  CHECK_THROWS_WITH(run(a), "out: expected x's dtype float32");
  a = c.args();
  a.out.shape[1] = 44;
  CHECK_THROWS_WITH(run(a), "out: expected size 45 in dim 1");
  a = c.args();
  a.activation = static_cast<ExpertActivation>(7);
  CHECK_THROWS_WITH(run(a), "activation: expected 0 (SwiGLU) or 1 (GptOss)");
  std::vector<float> biases(5 * (2 * 37 + 45));
  a = c.args();
  a.biases = TensorView::contiguous(biases.data(), DType::kFloat32, {5, 2 * 37 + 45});
  CHECK_THROWS_WITH(run(a), "biases: only activation GptOss takes biases");
  a.activation = ExpertActivation::kGptOss;
  a.biases.shape[1] = 2 * 37;
  CHECK_THROWS_WITH(run(a), "biases: expected size 119 in dim 1");
  a = c.args();
  a.activation = ExpertActivation::kGptOss;
  a.limit = std::numeric_limits<float>::infinity();
  CHECK_THROWS_WITH(run(a), "limit: must be finite");
  a = c.args();
  a.out.device = Device::kCUDA;
  CHECK_THROWS_WITH(run(a), "out: expected a tensor on cpu");
  a = c.args();
  a.x.device = Device::kCUDA;
  a.ids.device = a.weights.device = a.experts.device = a.out.device = Device::kCUDA;
  CHECK_THROWS_WITH(run(a), "x: expected a tensor on cpu");
  a = c.args();
  a.out = TensorView();
  CHECK_THROWS_WITH(run(a), "out: a tensor is required");

  // ids outside [0, E] are found by the kernel, which names the token and slot.
  c.ids[1 * 2 + 1] = 6;
  CHECK_THROWS_WITH(run(c.args()), "ids: ids[1, 1] = 6 is outside [0, 5]");
  c.ids[1 * 2 + 1] = -1;
  CHECK_THROWS_WITH(run(c.args()), "ids: ids[1, 1] = -1 is outside [0, 5]");
  c.ids[1 * 2 + 1] = 5;  // E: a dropped slot, fine
  run(c.args());
}

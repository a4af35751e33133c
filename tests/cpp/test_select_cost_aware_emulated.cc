// The GPU's select_cost_aware and tree_from_selection kernels (cpp/kernels/select_cost_aware.cuh),
// run on the CPU by the block emulator (tests/cpp/emulated), against the CPU reference: the C++
// select_cost_aware request after request with the buffer, S and A carried, and the verify tree
// built from the contract (root, then the chosen candidates in candidate order, ancestor-or-self
// masks). Random batches with ties on purpose (coarse scores, probabilities and buffers, repeated
// ids), every shared-memory plan (terms of all candidates or in chunks, buffer in shared or global
// memory), blocks of 32 to 1024 threads, and the block's threads in forward, reverse and shuffled
// order between barriers (a race would make the orders disagree). On a GPU:
// tests/gpu/test_select_cost_aware_cuda.py. Also the emulator's own faults, races and its play of
// programmatic dependent launch (a dependent's first block before its primary).
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "check.h"
#include <cuda_runtime.h>  // (tests/cpp/emulated: the block emulator's)
#include "moespec/select_cost_aware.h"
#include "moespec/tensor_view.h"
#include "select_cost_aware.cuh"

using namespace moespec;
using cuda::select_kernels::plan_select;
using cuda::select_kernels::select_kernel;
using cuda::select_kernels::select_layout;
using cuda::select_kernels::SelectPlan;
using cuda::select_kernels::tree_kernel;

namespace {

struct Case {
  int B = 1, C = 0, L = 0, K = 1, N = 1, total_tokens = 1;
  std::vector<int32_t> parents, depth, num_candidates, predicted;
  std::vector<float> scores, prob, buffer, expert_s;  // prob empty: all 1
  float token_s = 0.0f, cost_scale = 1.0f;
  double S = 0.0, A = 1.0;
};

struct Outcome {
  std::vector<int32_t> selected, count;
  std::vector<float> buffer;
  double S = 0.0, A = 0.0;
};

template <typename T>
T pick(std::mt19937& rng, std::initializer_list<T> values) {
  return values.begin()[std::uniform_int_distribution<std::size_t>(0, values.size() - 1)(rng)];
}

int uniform(std::mt19937& rng, int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }

Case random_case(std::mt19937& rng) {
  Case c;
  c.B = uniform(rng, 1, 3);
  c.C = uniform(rng, 0, 24);
  c.L = uniform(rng, 0, 5);
  c.K = uniform(rng, 1, 4);
  c.N = uniform(rng, 1, 10);
  c.total_tokens = uniform(rng, 1, c.C + 2);
  const bool soft = uniform(rng, 0, 1) == 1;
  const bool fine = uniform(rng, 0, 2) == 0;  // values whose sums round: an order of summation shows
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  auto coarse_or_fine = [&](float coarse, float scale) { return fine ? scale * unit(rng) : coarse; };
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int b = 0; b < c.B; ++b) {
    c.num_candidates.push_back(uniform(rng, 0, c.C));
    const int first = static_cast<int>(c.parents.size());
    for (int i = 0; i < c.C; ++i) {
      const int p = i == 0 || uniform(rng, 0, 2) == 0 ? -1 : uniform(rng, 0, i - 1);
      c.parents.push_back(p);
      c.depth.push_back(p < 0 ? 1 : c.depth[static_cast<std::size_t>(first + p)] + 1);
      const float parent_score = p < 0 ? 0.0f : c.scores[static_cast<std::size_t>(first + p)];
      c.scores.push_back(uniform(rng, 0, 9) == 0 ? ninf : parent_score + coarse_or_fine(pick(rng, {-0.25f, -0.5f, -1.0f, -2.0f}), -2.0f));
    }
  }
  for (int i = 0; i < c.B * c.C * c.L * c.K; ++i) {
    c.predicted.push_back(uniform(rng, 0, c.N - 1));
    if (soft) c.prob.push_back(coarse_or_fine(pick(rng, {0.0f, 0.25f, 0.5f, 1.0f, 0.3f}), 1.0f));
  }
  for (int i = 0; i < c.L * c.N; ++i) c.buffer.push_back(coarse_or_fine(pick(rng, {0.0f, 0.0f, 0.5f, 1.0f, 0.1f}), 1.0f));
  for (int l = 0; l < c.L; ++l) c.expert_s.push_back(coarse_or_fine(pick(rng, {0.0f, 0.001f, 0.002f, 0.0005f}), 0.0005f));
  c.token_s = pick(rng, {0.0f, 0.0f, 0.0001f, 0.001f});
  c.cost_scale = pick(rng, {1.0f, 1.0f, 0.5f, 0.0f});
  c.S = pick(rng, {0.0, 0.01, 0.05, 0.2});
  c.A = pick(rng, {1.0, 1.5, 3.0});
  if (fine && uniform(rng, 0, 1) == 0) c.S = 1e-6, c.A = 1e-4;  // S then holds the first cost to its last bits
  return c;
}

// The CPU reference: select_cost_aware request after request, as the eco selector calls it.
Outcome reference(const Case& c) {
  Outcome o;
  o.buffer = c.buffer;
  o.selected.assign(static_cast<std::size_t>(c.B * c.C), -1);
  std::vector<float> expert_s(c.expert_s);
  for (float& v : expert_s) v = c.cost_scale * v;
  o.S = c.S, o.A = c.A;
  const int64_t LK = static_cast<int64_t>(c.L) * c.K;
  for (int b = 0; b < c.B; ++b) {
    const int64_t n = c.num_candidates[static_cast<std::size_t>(b)], at = static_cast<int64_t>(b) * c.C;
    SelectCostAwareArgs a;
    auto ptr = [](const auto& v, int64_t offset) { return const_cast<void*>(static_cast<const void*>(v.data() + offset)); };
    a.parents = TensorView::contiguous(ptr(c.parents, at), DType::kInt32, {n});
    a.depth = TensorView::contiguous(ptr(c.depth, at), DType::kInt32, {n});
    a.scores = TensorView::contiguous(ptr(c.scores, at), DType::kFloat32, {n});
    a.predicted = TensorView::contiguous(ptr(c.predicted, at * LK), DType::kInt32, {n, c.L, c.K});
    if (!c.prob.empty()) a.predicted_p = TensorView::contiguous(ptr(c.prob, at * LK), DType::kFloat32, {n, c.L, c.K});
    a.buffer = TensorView::contiguous(o.buffer.data(), DType::kFloat32, {c.L, c.N});
    a.expert_s = TensorView::contiguous(expert_s.data(), DType::kFloat32, {c.L});
    a.selected = TensorView::contiguous(o.selected.data() + at, DType::kInt32, {n});
    a.step_s = o.S, a.accepted = o.A;
    a.token_s = c.token_s * c.cost_scale;
    a.total_tokens = c.total_tokens;
    const SelectCostAwareResult r = select_cost_aware(a);
    for (int64_t i = r.count; i < n; ++i) o.selected[static_cast<std::size_t>(at + i)] = -1;
    o.count.push_back(static_cast<int32_t>(r.count));
    o.S = r.step_s, o.A = r.accepted;
  }
  return o;
}

Outcome emulated(const Case& c, int64_t chunk, bool buffer_shared, unsigned threads, emu::Order order, uint64_t seed) {
  Outcome o;
  o.buffer = c.buffer;
  o.selected.assign(static_cast<std::size_t>(c.B * c.C), 12345);  // (the kernel writes every entry)
  o.count.assign(static_cast<std::size_t>(c.B), -7);
  double state[2] = {c.S, c.A};
  const std::size_t bytes = static_cast<std::size_t>(select_layout(c.C, c.L, c.N, chunk, buffer_shared).bytes);
  emu::launch(emu::Dim3{1, 1, 1}, emu::Dim3{threads, 1, 1}, bytes, order, seed, select_kernel<double>,
              c.parents.data(), c.depth.data(), c.scores.data(), c.num_candidates.data(), c.predicted.data(),
              c.prob.empty() ? nullptr : c.prob.data(), o.buffer.data(), c.expert_s.data(), state,
              o.selected.data(), o.count.data(), c.B, c.C, c.L, c.K, c.N, c.token_s * c.cost_scale, c.cost_scale,
              c.total_tokens, static_cast<int>(chunk), buffer_shared);
  o.S = state[0], o.A = state[1];
  return o;
}

std::string describe(const Case& c) {
  return "B=" + std::to_string(c.B) + " C=" + std::to_string(c.C) + " L=" + std::to_string(c.L) +
         " K=" + std::to_string(c.K) + " N=" + std::to_string(c.N) + " total=" + std::to_string(c.total_tokens) +
         (c.prob.empty() ? " hard" : " soft") + " scale=" + std::to_string(c.cost_scale);
}

bool same(const Outcome& a, const Outcome& b) {
  return a.selected == b.selected && a.count == b.count && a.buffer == b.buffer && a.S == b.S && a.A == b.A;
}

}  // namespace

TEST(the_selection_kernel_chooses_as_the_cpu_does_under_every_plan_and_thread_order) {
  std::mt19937 rng(20261207);
  const emu::Order orders[] = {emu::Order::kForward, emu::Order::kReverse, emu::Order::kShuffled};
  for (int trial = 0; trial < 160; ++trial) {
    const Case c = random_case(rng);
    const Outcome want = reference(c);
    const int64_t all = c.C > 0 ? c.C : 1;
    const struct {
      int64_t chunk;
      bool shared;
    } plans[] = {{all, true}, {all, false}, {3, true}, {1, false}};
    const unsigned threads = trial % 16 == 0 ? 1024u : trial % 5 == 0 ? 32u : 64u;
    for (const auto& plan : plans) {
      const emu::Order order = orders[static_cast<std::size_t>(trial) % 3];
      const Outcome got = emulated(c, plan.chunk, plan.shared, threads, order, static_cast<uint64_t>(trial));
      CHECK_MSG(same(got, want), describe(c) + " chunk=" + std::to_string(plan.chunk) +
                                     (plan.shared ? " shared" : " global") + " threads=" + std::to_string(threads));
    }
  }
}

TEST(the_selection_kernel_gives_every_thread_order_the_same_result) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 40; ++trial) {
    const Case c = random_case(rng);
    const Outcome first = emulated(c, 2, true, 64, emu::Order::kForward, 0);
    for (uint64_t seed = 1; seed < 4; ++seed)
      CHECK_MSG(same(emulated(c, 2, true, 64, emu::Order::kShuffled, seed), first), describe(c));
  }
}

TEST(a_plan_fits_its_budget_and_keeps_the_buffer_shared_while_32_candidates_fit) {
  // Qwen3-30B-A3B's 48 MoE layers, 128 experts; R = 64 candidates; an H100's 227 KB, less slack.
  SelectPlan p = plan_select(64, 48, 128, 223 * 1024);
  CHECK(p.chunk == 64 && p.buffer_shared && p.bytes <= 223 * 1024);
  p = plan_select(1024, 48, 128, 223 * 1024);  // 1024 candidates: terms in chunks, buffer shared
  CHECK(p.buffer_shared && p.chunk >= 32 && p.chunk < 1024);
  CHECK(p.bytes == select_layout(1024, 48, 128, p.chunk, true).bytes && p.bytes <= 223 * 1024);
  CHECK(select_layout(1024, 48, 128, p.chunk + 1, true).bytes > 223 * 1024);  // the largest chunk
  p = plan_select(64, 64, 4096, 100 * 1024);  // a buffer of 1 MB: global
  CHECK(!p.buffer_shared && p.chunk == 64);
  p = plan_select(8, 0, 16, 48 * 1024);  // no MoE layers
  CHECK(p.chunk == 8 && p.buffer_shared);
  p = plan_select(1 << 20, 48, 128, 48 * 1024);  // not even the acceptances fit
  CHECK(p.chunk == 0);
}

TEST(the_tree_kernel_builds_the_contracts_tree_from_a_selection) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 60; ++trial) {
    const Case c = random_case(rng);
    const Outcome sel = reference(c);
    int most = 0;
    for (int32_t n : sel.count) most = n > most ? n : most;
    const int M1 = most + 1 + uniform(rng, 0, 40), W = (M1 + 31) / 32, C = c.C > 0 ? c.C : 1;
    std::vector<int32_t> selected(sel.selected), cand_tokens, root_tokens;
    selected.resize(static_cast<std::size_t>(c.B * C), -1);
    std::vector<int32_t> parents(c.parents);
    parents.resize(static_cast<std::size_t>(c.B * C), -1);
    for (int i = 0; i < c.B * C; ++i) cand_tokens.push_back(1000 + i);
    for (int b = 0; b < c.B; ++b) root_tokens.push_back(7 + b);
    std::vector<int32_t> tokens(static_cast<std::size_t>(c.B * M1), -9), par(tokens), dep(tokens),
        mask(static_cast<std::size_t>(c.B * M1 * W), -9), num_nodes(static_cast<std::size_t>(c.B), -9);
    emu::launch(emu::Dim3{static_cast<unsigned>(c.B), 1, 1}, emu::Dim3{32, 1, 1}, sizeof(int32_t) * C,
                emu::Order::kShuffled, static_cast<uint64_t>(trial), tree_kernel, selected.data(), sel.count.data(),
                parents.data(), cand_tokens.data(), root_tokens.data(), tokens.data(), par.data(), dep.data(),
                mask.data(), num_nodes.data(), C, M1, W);
    for (int b = 0; b < c.B; ++b) {  // the contract, from scratch
      std::vector<int> node_of(static_cast<std::size_t>(C), -1), nodes{-1};
      for (int i = 0; i < sel.count[static_cast<std::size_t>(b)]; ++i)
        node_of[static_cast<std::size_t>(selected[static_cast<std::size_t>(b * C + i)])] = 0;
      for (int k = 0; k < C; ++k)
        if (node_of[static_cast<std::size_t>(k)] == 0) node_of[static_cast<std::size_t>(k)] = static_cast<int>(nodes.size()), nodes.push_back(k);
      CHECK(num_nodes[static_cast<std::size_t>(b)] == static_cast<int32_t>(nodes.size()));
      for (int i = 0; i < M1; ++i) {
        const std::size_t r = static_cast<std::size_t>(b * M1 + i);
        int want_parent = -1, want_depth = 0, want_token = 0;
        std::vector<int32_t> want_mask(static_cast<std::size_t>(W), 0);
        if (i < static_cast<int>(nodes.size())) {
          auto node = [&](int j) { return static_cast<std::size_t>(b * C + nodes[static_cast<std::size_t>(j)]); };
          auto parent_node = [&](int j) {
            const int p = parents[node(j)];
            return p < 0 ? 0 : node_of[static_cast<std::size_t>(p)];
          };
          want_token = i == 0 ? root_tokens[static_cast<std::size_t>(b)] : cand_tokens[node(i)];
          want_parent = i == 0 ? -1 : parent_node(i);
          for (int j = i;; j = parent_node(j)) {  // ancestors or self
            want_mask[static_cast<std::size_t>(j / 32)] |= static_cast<int32_t>(1u << (j % 32));
            if (j == 0) break;
            ++want_depth;
          }
        }
        CHECK(tokens[r] == want_token && par[r] == want_parent && dep[r] == want_depth);
        for (int w = 0; w < W; ++w) CHECK(mask[r * static_cast<std::size_t>(W) + static_cast<std::size_t>(w)] == want_mask[static_cast<std::size_t>(w)]);
      }
    }
  }
}

TEST(the_emulator_reports_a_barrier_that_not_every_thread_reaches) {
  struct Divergent {
    static void kernel(int* out) {
      if (threadIdx.x < 16) __syncthreads();  // a deadlock on a GPU
      out[threadIdx.x] = 1;
    }
  };
  std::vector<int> out(64, 0);
  bool caught = false;
  try {
    emu::launch(emu::Dim3{1, 1, 1}, emu::Dim3{64, 1, 1}, 0, emu::Order::kForward, 0, &Divergent::kernel, out.data());
  } catch (const emu::Fault&) {
    caught = true;
  }
  CHECK(caught);
}

TEST(the_emulator_shows_a_race_as_orders_that_disagree) {
  struct Racy {
    static void kernel(int* out) {
      __shared__ int slot;
      if (threadIdx.x == 0) slot = 1;
      __syncthreads();
      if (threadIdx.x == 1) slot = 2;        // thread 1 writes what thread 0 reads
      if (threadIdx.x == 0) out[0] = slot;  // with no barrier between them
    }
  };
  std::vector<int> forward(1), reverse(1);
  emu::launch(emu::Dim3{1, 1, 1}, emu::Dim3{64, 1, 1}, 0, emu::Order::kForward, 0, &Racy::kernel, forward.data());
  emu::launch(emu::Dim3{1, 1, 1}, emu::Dim3{64, 1, 1}, 0, emu::Order::kReverse, 0, &Racy::kernel, reverse.data());
  CHECK(forward[0] == 1 && reverse[0] == 2);
}

// Programmatic dependent launch as the emulator plays it (cuda_emulator.h): a dependent's first block
// runs up to its wait before its primary has run, so a read of the primary's output before the wait
// shows, and a dependent block that returns without waiting is a fault.
namespace pdl {
void produce(int* out) {
  moespec::cuda::device::wait_for_primary();
  moespec::cuda::device::launch_dependents();
  out[blockIdx.x * blockDim.x + threadIdx.x] = static_cast<int>(blockIdx.x) + 1;
}
void consume_after_wait(const int* in, int* out) {
  moespec::cuda::device::wait_for_primary();
  const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  out[i] = in[i];
}
void consume_before_wait(const int* in, int* out) {
  const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  const int v = in[i];  // (the bug: the primary's output read before the wait)
  moespec::cuda::device::wait_for_primary();
  out[i] = v;
}
void consume_without_wait(const int* in, int* out) {
  if (blockIdx.x == 1) return;  // (the bug: a block that never waits)
  moespec::cuda::device::wait_for_primary();
  out[blockIdx.x * blockDim.x + threadIdx.x] = in[blockIdx.x * blockDim.x + threadIdx.x];
}

constexpr moespec::cuda::Pdl kLate{true, false}, kEarly{true, true};  // (dependent launches)

// produce -> consume on 4 blocks of 32, the consumer a programmatic dependent or not; its output.
std::vector<int> run(void (*consume)(const int*, int*), bool dependent, cudaError_t* sync = nullptr) {
  std::vector<int> mid(128, 0), out(128, -1);
  CHECK(moespec::cuda::launch_kernel(kLate, &produce, dim3(4), dim3(32), 0, nullptr, mid.data()) == cudaSuccess);
  CHECK(moespec::cuda::launch_kernel(moespec::cuda::Pdl{dependent, false}, consume, dim3(4), dim3(32), 0, nullptr,
                                     static_cast<const int*>(mid.data()), out.data()) == cudaSuccess);
  const cudaError_t status = cudaStreamSynchronize(nullptr);
  if (sync != nullptr) *sync = status;
  else CHECK(status == cudaSuccess);
  (void)cudaGetLastError();
  return out;
}
std::vector<int> produced() {
  std::vector<int> want(128);
  for (int i = 0; i < 128; ++i) want[static_cast<std::size_t>(i)] = i / 32 + 1;
  return want;
}
// A kernel between the two: releases its dependents early or after its wait, then marks `seen`.
void relay(int* seen, bool early) {
  moespec::cuda::device::release_and_wait(early);
  seen[blockIdx.x * blockDim.x + threadIdx.x] = 1;
}
// produce -> relay -> consume (all programmatic dependents; relay's release early or not); the output.
std::vector<int> run_through_relay(void (*consume)(const int*, int*), bool early) {
  std::vector<int> mid(128, 0), seen(128, 0), out(128, -1);
  CHECK(moespec::cuda::launch_kernel(kLate, &produce, dim3(4), dim3(32), 0, nullptr, mid.data()) == cudaSuccess);
  CHECK(moespec::cuda::launch_kernel(moespec::cuda::Pdl{true, early}, &relay, dim3(4), dim3(32), 0, nullptr,
                                     seen.data(), early) == cudaSuccess);
  CHECK(moespec::cuda::launch_kernel(kLate, consume, dim3(4), dim3(32), 0, nullptr,
                                     static_cast<const int*>(mid.data()), out.data()) == cudaSuccess);
  CHECK(cudaStreamSynchronize(nullptr) == cudaSuccess);
  CHECK(seen == std::vector<int>(128, 1));
  return out;
}
// Blocks of `got` that hold what was there before `produce` ran (zeros), and its output.
std::pair<int, int> stale_and_right(const std::vector<int>& got) {
  const std::vector<int> want = produced();
  int stale = 0, right = 0;
  for (std::size_t b = 0; b < 4; ++b) {
    const std::vector<int> block(got.begin() + 32 * b, got.begin() + 32 * (b + 1));
    stale += block == std::vector<int>(32, 0);
    right += block == std::vector<int>(want.begin() + 32 * b, want.begin() + 32 * (b + 1));
  }
  return {stale, right};
}
void release_after_wait(int* out) {  // (the bug, in a launch declaring an early release)
  moespec::cuda::device::wait_for_primary();
  moespec::cuda::device::launch_dependents();
  out[threadIdx.x] = 1;
}
void release_before_wait(int* out) {  // (the bug, in a launch declaring none)
  moespec::cuda::device::launch_dependents();
  moespec::cuda::device::wait_for_primary();
  out[threadIdx.x] = 1;
}
// produce -> `kernel` (a dependent, declared early or not); the error of the synchronisation.
std::string fault(void (*kernel)(int*), moespec::cuda::Pdl pdl) {
  std::vector<int> mid(128, 0), out(32, 0);
  CHECK(moespec::cuda::launch_kernel(kLate, &produce, dim3(4), dim3(32), 0, nullptr, mid.data()) == cudaSuccess);
  CHECK(moespec::cuda::launch_kernel(pdl, kernel, dim3(1), dim3(32), 0, nullptr, out.data()) == cudaSuccess);
  const cudaError_t status = cudaStreamSynchronize(nullptr);
  (void)cudaGetLastError();
  return status == cudaSuccess ? std::string() : std::string(cudaGetErrorString(status));
}
}  // namespace pdl

TEST(a_dependent_launch_that_waits_reads_its_primarys_output) {
  CHECK(pdl::run(&pdl::consume_after_wait, true) == pdl::produced());
}

TEST(a_dependent_launch_that_reads_before_its_wait_reads_what_was_there_before_its_primary) {
  // (blocks that read before the primary ran: its first, one; the others after)
  CHECK(pdl::stale_and_right(pdl::run(&pdl::consume_before_wait, true)) == std::make_pair(1, 3));
  CHECK(pdl::run(&pdl::consume_before_wait, false) == pdl::produced());  // (a plain launch: after its primary)
}

TEST(a_dependent_block_that_returns_without_waiting_is_a_fault) {
  cudaError_t status = cudaSuccess;
  pdl::run(&pdl::consume_without_wait, true, &status);
  CHECK(status != cudaSuccess);
  CHECK(std::string(cudaGetErrorString(status)).find("without waiting for its primary") != std::string::npos);
  CHECK(pdl::run(&pdl::consume_without_wait, false) != pdl::produced());  // (plain: no rule; block 1 writes nothing)
}

// A chain of early releases: the consumer may start before the relay's primary (produce) has run, so
// a read of produce's output before the consumer's wait shows (the first block); after a late release
// it cannot (the MoE down kernel reads the routing output, its primary's primary, before its wait).
TEST(a_read_before_the_wait_of_its_primarys_primary_shows_only_after_an_early_release) {
  for (int i = 0; i < 2; ++i) {  // (the late chain is played two ways in turn: cuda_emulator.h's enqueue)
    CHECK(pdl::stale_and_right(pdl::run_through_relay(&pdl::consume_before_wait, true)) == std::make_pair(1, 3));
    CHECK(pdl::stale_and_right(pdl::run_through_relay(&pdl::consume_before_wait, false)) == std::make_pair(0, 4));
    CHECK(pdl::run_through_relay(&pdl::consume_after_wait, true) == pdl::produced());
  }
}

TEST(a_release_elsewhere_than_the_launch_declares_is_a_fault) {
  CHECK(pdl::fault(&pdl::release_after_wait, pdl::kEarly).find("declares an early release") != std::string::npos);
  CHECK(pdl::fault(&pdl::release_before_wait, pdl::kLate).find("does not declare an early release") !=
        std::string::npos);
  CHECK(pdl::fault(&pdl::release_after_wait, pdl::kLate).empty());
  CHECK(pdl::fault(&pdl::release_before_wait, pdl::kEarly).empty());
}

// A CUDA block emulator: moespec's kernels' CUDA source runs on the CPU, so that their logic is
// checked against the CPU references in CI although no GPU runs here. Used through the shim headers
// beside it (cuda_runtime.h, cuda_bf16.h: what a kernel source includes), which map the CUDA
// built-ins onto this file.
//
// Each thread of a block is a fiber on the calling thread; a block's fibers run one after another
// from barrier to barrier (__syncthreads and its _count/_and/_or forms; __syncwarp, the shuffles,
// votes and mma.sync over a warp's lanes), in an order chosen per launch: forward, reverse or
// shuffled (MOESPEC_EMULATED_ORDER, or the tests' argument). A kernel whose result depends on that
// order has a race between two barriers (one thread writes what another reads or writes). A barrier
// that not every live thread of its scope reaches (a divergent __syncthreads, a lane that left
// before a shuffle) is a deadlock on a GPU and an emu::Fault here, as is a launch past CUDA's limits
// (block size, grid y/z, more than 48 KB of dynamic shared memory without the kernel's attribute).
// Blocks run one at a time (in index order, or reversed or shuffled with the threads), so atomics are
// plain read-modify-writes, a kernel's `__shared__` variables are function-local statics and its
// dynamic shared memory a buffer per block (filled with 0xcd: a GPU's is not zeroed).
//
// Programmatic dependent launch is played against the kernel: a launch through the shim
// (cudaLaunchKernelEx) is deferred until the next launch or a synchronisation, and a programmatic
// dependent's first block (in the launch's order) runs up to its wait (griddepcontrol.wait,
// moespec's wait_for_primary) before its primary has run at all; the primary runs then, the rest
// after it. A GPU starts a dependent once every block of its primary has called launch_dependents:
// where the primary's blocks do so after their own wait, the primary's primaries have run first;
// where the launch declares that its blocks release early, at their start (the emulator's launch
// attribute, early_release_attribute), the dependent's first block runs up to its wait before the
// primary's primaries too, down a chain of early releases. So a block that reads its primary's output
// (or a kernel's further up an early chain), or writes what they read, before its wait gets another
// result than the other orders; a block of a dependent launch that returns without waiting (which
// would let a kernel after it see it complete before its primary), or whose threads call
// launch_dependents elsewhere than the launch declares (before their wait when it does not declare
// early, after it or not at all before it when it does), is a fault.
//
// What it cannot show: speed, memory-model subtleties within a phase, blocks of one kernel running
// at once, the bits of an approximate device function (expf, rsqrtf: the host's are used).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__) && !defined(MOESPEC_EMU_UCONTEXT)
#define MOESPEC_EMU_ASM_SWITCH 1  // a hand-written switch: no signal-mask system call per switch
#else
#include <ucontext.h>
#endif

namespace emu {

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

struct Fault : std::runtime_error {
  using std::runtime_error::runtime_error;
};

enum class Order { kForward, kReverse, kShuffled };

inline Dim3 thread_idx, block_idx, block_dim, grid_dim;

#ifdef MOESPEC_EMU_ASM_SWITCH
// emu_switch(&from_sp, to_sp): saves the callee-saved registers on this stack, stores its pointer in
// *from_sp and resumes the stack to_sp (not MXCSR nor the x87 control word: no kernel changes the
// floating-point environment, which the fibers share). A naked inline function, not a top-level asm
// block: every translation unit that includes this header may define it.
__attribute__((naked, noinline)) inline void emu_switch(void** /*from_sp: rdi*/, void* /*to_sp: rsi*/) {
  asm(R"(
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
)");
}
#endif

// A collective over some threads (a warp's lanes, or the block): each posts `data`; when all have
// arrived, `run(data of each participant, count)` runs once, then each reads its own data back.
struct Collective {
  void (*run)(void** data, unsigned count, unsigned mask) = nullptr;
  void* data = nullptr;
  unsigned mask = 0;  // warp collectives: the lanes
};

class Block {
 public:
  enum class State { kReady, kBlock, kWarp, kPrimary, kDone };

  // Runs body() once per thread of a block of `threads` fibers (threadIdx set before each switch).
  // A block of a programmatic dependent launch (`dependent`) must wait for its primary before it
  // returns; `primary`, when given and not empty, is run once every thread of the block waits for it
  // (or has returned) and nothing else can go on.
  void run(unsigned threads, const std::function<void()>& body, Order order, uint64_t seed, bool dependent = false,
           std::function<void()>* primary = nullptr, bool early = false) {
    if (threads == 0 || threads > 1024) throw Fault("block size must be in [1, 1024]");
    n_ = threads;
    body_ = &body;
    dependent_ = dependent;
    early_ = early;
    waited_ = false;
    thread_waited_.assign(n_, false);
    thread_released_.assign(n_, false);
    primary_ = primary != nullptr && *primary ? primary : nullptr;
    state_.assign(n_, State::kReady);
    post_.assign(n_, Collective{});
    while (stacks_.size() < n_) stacks_.push_back(std::make_unique<char[]>(kStack));
    sp_.assign(n_, nullptr);
    for (unsigned t = 0; t < n_; ++t) start(t);
    std::vector<unsigned> seq(n_);
    std::iota(seq.begin(), seq.end(), 0u);
    if (order == Order::kReverse) std::reverse(seq.begin(), seq.end());
    std::mt19937_64 rng(seed);
    self() = this;
    for (;;) {
      if (order == Order::kShuffled) std::shuffle(seq.begin(), seq.end(), rng);
      bool ran = false;
      for (unsigned t : seq)
        if (state_[t] == State::kReady) {
          ran = true;
          resume(t);
          if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
        }
      if (ran) continue;
      if (std::all_of(state_.begin(), state_.end(), [](State s) { return s == State::kDone; })) break;
      release();
    }
    if (dependent_ && !waited_)
      throw Fault("a block of a programmatic dependent launch returned without waiting for its primary "
                  "(wait_for_primary): a kernel after it could see it complete before its primary");
  }

  // griddepcontrol.wait: parks the thread while this block holds its launch's primary, not yet run.
  void wait_for_primary() {
    if (early_ && !thread_released_[current_])
      throw Fault("wait_for_primary before launch_dependents in a launch that declares an early release: the "
                  "emulator plays its dependents as starting before its primary is complete");
    waited_ = true;
    thread_waited_[current_] = true;
    if (primary_ != nullptr) wait(State::kPrimary, Collective{});
  }

  // griddepcontrol.launch_dependents: after the thread's wait in a dependent launch (which the play
  // of a late release relies on: its dependents start after its primary's primaries are complete),
  // before it where the launch declares an early release.
  void launch_dependents() {
    if (early_ && thread_waited_[current_])
      throw Fault("launch_dependents after wait_for_primary in a launch that declares an early release");
    if (dependent_ && !early_ && !thread_waited_[current_])
      throw Fault("launch_dependents before wait_for_primary in a programmatic dependent launch that does not "
                  "declare an early release: its dependents could start before its own primary is complete");
    thread_released_[current_] = true;
  }

  // A block collective (__syncthreads and its forms): every live thread must arrive.
  void block_wait(void* data, void (*run)(void**, unsigned, unsigned)) { wait(State::kBlock, Collective{run, data, 0u}); }

  // A warp collective over the lanes of `mask` (this thread's warp; the mask must include it and be
  // the same in every lane).
  void warp_wait(unsigned mask, void* data, void (*run)(void**, unsigned, unsigned)) {
    if (!((mask >> (current_ % 32)) & 1u)) throw Fault("a lane calls a warp collective with a mask that omits it");
    wait(State::kWarp, Collective{run, data, mask});
  }

  unsigned lane() const { return current_ % 32; }

  static Block*& self() {
    static Block* b = nullptr;
    return b;
  }

 private:
  static constexpr std::size_t kStack = 64 * 1024;

  static void entry() {
    Block* b = self();
    try {
      (*b->body_)();
    } catch (...) {
      b->error_ = std::current_exception();
    }
    b->state_[b->current_] = State::kDone;
    b->back();  // never resumed again
  }

#ifdef MOESPEC_EMU_ASM_SWITCH
  void start(unsigned t) {
    auto* top = reinterpret_cast<uint64_t*>(stacks_[t].get() + kStack);  // 16-aligned (new[] of a multiple of 16)
    uint64_t* sp = top - 8;
    for (int i = 0; i < 6; ++i) sp[i] = 0;  // r15 .. rbp
    sp[6] = reinterpret_cast<uint64_t>(&Block::entry);
    sp[7] = 0;  // (entry's return address: it never returns; entry starts with rsp = 8 mod 16, as called)
    sp_[t] = sp;
  }
  void resume(unsigned t) {
    current_ = t;
    set_index(t);
    emu_switch(&main_sp_, sp_[t]);
  }
  void back() { emu_switch(&sp_[current_], main_sp_); }
#else
  void start(unsigned t) {
    ctx_.resize(n_);
    getcontext(&ctx_[t]);
    ctx_[t].uc_stack.ss_sp = stacks_[t].get();
    ctx_[t].uc_stack.ss_size = kStack;
    ctx_[t].uc_link = &main_;
    makecontext(&ctx_[t], reinterpret_cast<void (*)()>(&Block::entry), 0);
  }
  void resume(unsigned t) {
    current_ = t;
    set_index(t);
    swapcontext(&main_, &ctx_[t]);
  }
  void back() { swapcontext(&ctx_[current_], &main_); }
#endif

  void set_index(unsigned t) {
    thread_idx = Dim3{t % block_dim.x, (t / block_dim.x) % block_dim.y, t / (block_dim.x * block_dim.y)};
  }

  void wait(State s, Collective c) {
    state_[current_] = s;
    post_[current_] = c;
    back();
  }

  // No fiber is ready: release the complete warp collectives, else the block's barrier, else fail
  // naming the deadlock.
  void release() {
    void* data[32];
    bool released = false;
    for (unsigned w = 0; w * 32 < n_; ++w) {  // every complete warp collective, in one pass
      Collective incomplete[32];               // (the kinds and masks of this warp found incomplete)
      unsigned known = 0;
      for (unsigned t = w * 32; t < std::min(n_, w * 32 + 32); ++t) {
        if (state_[t] != State::kWarp) continue;
        const Collective c = post_[t];
        if (std::any_of(incomplete, incomplete + known,
                        [&](const Collective& i) { return i.mask == c.mask && i.run == c.run; }))
          continue;
        bool complete = true;
        unsigned count = 0;
        for (unsigned l = 0; l < 32 && complete; ++l) {
          data[l] = nullptr;
          if (!((c.mask >> l) & 1u)) continue;
          const unsigned u = w * 32 + l;
          complete = u < n_ && state_[u] == State::kWarp && post_[u].mask == c.mask && post_[u].run == c.run;
          if (complete) data[l] = post_[u].data, ++count;
        }
        if (!complete) {
          incomplete[known++] = c;
          continue;
        }
        c.run(data, count, c.mask);
        for (unsigned l = 0; l < 32; ++l)
          if ((c.mask >> l) & 1u) state_[w * 32 + l] = State::kReady;
        released = true;
      }
    }
    if (released) return;
    if (std::find(state_.begin(), state_.end(), State::kPrimary) != state_.end()) {
      run_primary();
      for (State& s : state_)
        if (s == State::kPrimary) s = State::kReady;
      return;
    }
    bool any_block = false;
    for (unsigned t = 0; t < n_; ++t) any_block |= state_[t] == State::kBlock;
    if (!any_block) throw Fault("deadlock: a warp collective whose lanes do not all arrive (or differ in kind or mask)");
    std::vector<void*> all(n_);
    for (unsigned t = 0; t < n_; ++t) {
      if (state_[t] != State::kBlock || post_[t].run != post_[0].run)
        throw Fault(std::string("__syncthreads not reached by thread ") + std::to_string(t) +
                    (state_[t] == State::kDone ? " (it returned)" : " (it waits elsewhere)"));
      all[t] = post_[t].data;
    }
    post_[0].run(all.data(), n_, 0u);
    for (unsigned t = 0; t < n_; ++t) state_[t] = State::kReady;
  }

  // Runs the primary launch (other blocks, other fibers) between two of this block's phases: the
  // launch globals, the current block and the dynamic shared memory (whose storage this block's
  // threads point into) are set aside and restored, whatever the primary throws.
  void run_primary();

  unsigned n_ = 0, current_ = 0;
  bool dependent_ = false, early_ = false, waited_ = false;
  std::vector<bool> thread_waited_, thread_released_;  // (each thread's wait and release, in order)
  std::function<void()>* primary_ = nullptr;
  const std::function<void()>* body_ = nullptr;
  std::vector<State> state_;
  std::vector<Collective> post_;
  std::vector<std::unique_ptr<char[]>> stacks_;
  std::vector<void*> sp_;
  void* main_sp_ = nullptr;
#ifndef MOESPEC_EMU_ASM_SWITCH
  std::vector<ucontext_t> ctx_;
  ucontext_t main_{};
#endif
  std::exception_ptr error_;
};

inline std::vector<unsigned char>& dynamic_shared_buffer() {
  static std::vector<unsigned char> buf;
  return buf;
}

inline void Block::run_primary() {
  struct Aside {
    Dim3 thread, block, dim, grid;
    Block* self;
    std::vector<unsigned char> shared;
    Aside() : thread(thread_idx), block(block_idx), dim(block_dim), grid(grid_dim), self(Block::self()) {
      shared.swap(dynamic_shared_buffer());
    }
    ~Aside() {
      thread_idx = thread, block_idx = block, block_dim = dim, grid_dim = grid, Block::self() = self;
      shared.swap(dynamic_shared_buffer());
    }
  } aside;
  std::function<void()> primary = std::move(*primary_);
  *primary_ = nullptr;
  primary_ = nullptr;
  primary();
}

// The order of a launch's threads: the tests' choice, else MOESPEC_EMULATED_ORDER (forward, reverse,
// shuffled), else forward.
inline Order& default_order() {
  static Order order = [] {
    const char* env = std::getenv("MOESPEC_EMULATED_ORDER");
    if (env == nullptr || std::strcmp(env, "forward") == 0) return Order::kForward;
    if (std::strcmp(env, "reverse") == 0) return Order::kReverse;
    if (std::strcmp(env, "shuffled") == 0) return Order::kShuffled;
    throw Fault("MOESPEC_EMULATED_ORDER must be forward, reverse or shuffled");
  }();
  return order;
}

// A launch's grid and block within CUDA's limits, else a fault naming them.
inline void check_launch(Dim3 grid, Dim3 block) {
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (threads == 0 || threads > 1024 || block.z > 64) throw Fault("launch: a block of 1 to 1024 threads (z <= 64)");
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535)
    throw Fault("launch: grid dimensions out of range (y, z <= 65535)");
}

// How a launch relates to the one before it: a programmatic dependent (its blocks must wait for it),
// and the primary itself when it has not run yet (the first block runs it from its wait); whether
// its blocks release their own dependents early (before their wait).
struct Dependence {
  bool dependent = false;
  std::function<void()> primary;
  bool early = false;
};

// The fibers of the launches running: one Block a nesting level (a primary runs inside a block of
// its dependent), whatever the kernel.
struct Runners {
  std::vector<std::unique_ptr<Block>> blocks;
  std::size_t depth = 0;
  static Runners& get() {
    static Runners r;
    return r;
  }
};

// kernel<<<grid, block, shared_bytes>>>(args...): one block after another, in the order of `order`
// too (forward: index order; reverse; shuffled), so that a kernel whose blocks depend on each other's
// order (rather than on atomics, as a last-block pattern does) gives different results.
template <typename Kernel, typename... Args>
void launch_after(Dependence dependence, Dim3 grid, Dim3 block, std::size_t shared_bytes, Order order, uint64_t seed,
                  Kernel kernel, Args... args) {
  check_launch(grid, block);
  Runners& runners = Runners::get();
  if (runners.blocks.size() <= runners.depth) runners.blocks.push_back(std::make_unique<Block>());
  struct Nest {
    Runners& r;
    explicit Nest(Runners& r_) : r(r_) { ++r.depth; }
    ~Nest() { --r.depth; }
  } nest(runners);
  Block& runner = *runners.blocks[runners.depth - 1];
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  grid_dim = grid;
  block_dim = block;
  const std::function<void()> body = [&] { kernel(args...); };
  const uint64_t blocks = uint64_t{grid.x} * grid.y * grid.z;
  std::vector<uint64_t> seq(order == Order::kForward ? 0 : blocks);  // (forward: no list of a large grid)
  std::iota(seq.begin(), seq.end(), uint64_t{0});
  if (order == Order::kReverse) std::reverse(seq.begin(), seq.end());
  if (order == Order::kShuffled) std::shuffle(seq.begin(), seq.end(), std::mt19937_64(seed ^ 0x9e3779b97f4a7c15ull));
  for (uint64_t i = 0; i < blocks; ++i) {
    const uint64_t b = order == Order::kForward ? i : seq[i];
    const unsigned x = static_cast<unsigned>(b % grid.x), y = static_cast<unsigned>(b / grid.x % grid.y),
                   z = static_cast<unsigned>(b / (uint64_t{grid.x} * grid.y));
    block_idx = Dim3{x, y, z};
    dynamic_shared_buffer().assign(shared_bytes + 16, 0xcd);  // (uninitialised on a GPU: not zero here)
    runner.run(static_cast<unsigned>(threads), body, order, seed + x + 7919u * y + 104729u * z,
               dependence.dependent, i == 0 ? &dependence.primary : nullptr, dependence.early);
  }
  if (dependence.primary) dependence.primary();  // (an empty grid)
}

template <typename Kernel, typename... Args>
void launch(Dim3 grid, Dim3 block, std::size_t shared_bytes, Order order, uint64_t seed, Kernel kernel,
            Args... args) {
  launch_after(Dependence{}, grid, block, shared_bytes, order, seed, kernel, args...);
}

// The launches made through the shim and not run yet: a chain, each a programmatic dependent of the
// one before, whose first launch's primaries have all run. Every launch of the chain but its last
// releases early, so the last may start before any other of the chain has run: the chain runs
// nested, the last launch's first block up to its wait, then from there the launch before it (its
// first block up to its wait, and so on down the chain), each launch's other blocks once its primary
// has run. A dependent of a launch that releases after its wait starts only once that launch's
// primaries are complete: it arms one of two chains, the pending one (it runs after it) or the pending
// one's last launch with it (what comes before runs first), in turn (one block of a kernel at a time:
// its `__shared__` variables are statics here, so a kernel is never pending twice).
struct Stream {
  struct Pending {
    std::function<void(std::function<void()>)> run;  // the launch, given its primary's run (or nothing)
    const void* kernel;
    bool early;  // its blocks release their dependents early
  };
  std::vector<Pending> launches;
  bool later = false;  // (the chain the next dependent of a late release arms)
};
inline Stream& stream() {
  static Stream s;
  return s;
}

// Runs the chain `launches` (moved from the stream first: a fault leaves nothing pending), nested:
// launch i with launches 0 .. i - 1 as its primary.
inline void run_chain(std::vector<Stream::Pending> launches) {
  std::function<void(std::size_t)> run = [&](std::size_t i) {
    launches[i].run(i == 0 ? std::function<void()>() : std::function<void()>([&run, i] { run(i - 1); }));
  };
  if (!launches.empty()) run(launches.size() - 1);
}

// Runs what is pending on the stream; a fault of it is thrown here.
inline void synchronize() {
  std::vector<Stream::Pending> launches = std::move(stream().launches);
  stream().launches.clear();
  run_chain(std::move(launches));
}

// Enqueues kernel<<<grid, block, shared_bytes>>>(args...) on the stream: after what is pending, as
// its programmatic dependent when `dependent`, else once it has run; `early`: its blocks release
// their own dependents early.
template <typename Kernel, typename... Args>
void enqueue(bool dependent, bool early, Dim3 grid, Dim3 block, std::size_t shared_bytes, Order order, Kernel kernel,
             Args... args) {
  check_launch(grid, block);
  Stream& s = stream();
  Stream::Pending launch{[=, params = std::make_tuple(args...)](std::function<void()> primary) {
                           std::apply([&](auto... a) {
                             launch_after(Dependence{dependent, std::move(primary), early}, grid, block,
                                          shared_bytes, order, 0, kernel, a...);
                           }, params);
                         },
                         reinterpret_cast<const void*>(kernel), early};
  const bool again = std::any_of(s.launches.begin(), s.launches.end(),
                                 [&](const Stream::Pending& p) { return p.kernel == launch.kernel; });
  if (!dependent || again) {
    synchronize();
  } else if (!s.launches.empty() && s.launches.back().early) {
    // (the chain grows: this launch may start before any launch of it has run)
  } else if (s.launches.size() >= 2 && (s.later = !s.later)) {  // arm the later chain: what comes before first
    std::vector<Stream::Pending> chain = std::move(s.launches);
    s.launches.clear();
    Stream::Pending last = std::move(chain.back());
    chain.pop_back();
    run_chain(std::move(chain));
    s.launches.push_back(std::move(last));
  } else if (s.launches.size() >= 2) {  // keep the pending chain armed: this launch after it
    synchronize();
  }
  s.launches.push_back(std::move(launch));
}

template <typename T>
uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8, "shuffles move at most 64 bits");
  uint64_t u = 0;
  std::memcpy(&u, &v, sizeof(T));
  return u;
}
template <typename T>
T from_bits(uint64_t u) {
  T v;
  std::memcpy(&v, &u, sizeof(T));
  return v;
}

// ---- warp and block collectives ------------------------------------------------------------------

struct Exchange {  // a shuffle: in, the source lane (-1: keep in), out
  uint64_t in, out;
  int src;
};
inline void run_exchange(void** data, unsigned, unsigned mask) {
  for (unsigned l = 0; l < 32; ++l) {
    if (!data[l]) continue;
    auto* e = static_cast<Exchange*>(data[l]);
    const int s = e->src;
    e->out = s >= 0 && s < 32 && ((mask >> s) & 1u) ? static_cast<Exchange*>(data[s])->in : e->in;
  }
}
inline uint64_t exchange(unsigned mask, uint64_t in, int src) {
  Exchange e{in, in, src};
  Block::self()->warp_wait(mask, &e, &run_exchange);
  return e.out;
}

struct Vote {  // ballot / match: in, out
  uint64_t in;
  unsigned out;
};
inline void run_ballot(void** data, unsigned, unsigned) {
  unsigned bits = 0;
  for (unsigned l = 0; l < 32; ++l)
    if (data[l] && static_cast<Vote*>(data[l])->in) bits |= 1u << l;
  for (unsigned l = 0; l < 32; ++l)
    if (data[l]) static_cast<Vote*>(data[l])->out = bits;
}
inline void run_match(void** data, unsigned, unsigned) {
  for (unsigned l = 0; l < 32; ++l) {
    if (!data[l]) continue;
    unsigned bits = 0;
    for (unsigned j = 0; j < 32; ++j)
      if (data[j] && static_cast<Vote*>(data[j])->in == static_cast<Vote*>(data[l])->in) bits |= 1u << j;
    static_cast<Vote*>(data[l])->out = bits;
  }
}
inline unsigned vote(unsigned mask, uint64_t in, void (*run)(void**, unsigned, unsigned)) {
  Vote v{in, 0u};
  Block::self()->warp_wait(mask, &v, run);
  return v.out;
}

struct Reduce {  // __reduce_*_sync: in, out = the reduction over the mask's lanes
  uint32_t in, out;
};
template <typename Op>
void run_reduce(void** data, unsigned, unsigned) {
  const Reduce* first = nullptr;
  uint32_t r = 0;
  for (unsigned l = 0; l < 32; ++l) {
    if (!data[l]) continue;
    const auto* x = static_cast<Reduce*>(data[l]);
    r = first ? Op{}(r, x->in) : x->in;
    first = first ? first : x;
  }
  for (unsigned l = 0; l < 32; ++l)
    if (data[l]) static_cast<Reduce*>(data[l])->out = r;
}
template <typename Op>
uint32_t reduce(unsigned mask, uint32_t in) {
  Reduce r{in, 0u};
  Block::self()->warp_wait(mask, &r, &run_reduce<Op>);
  return r.out;
}

struct Count {  // __syncthreads_count / _and / _or: in, out = how many threads had in != 0
  int in, out;
};
inline void run_count(void** data, unsigned n, unsigned) {
  int c = 0;
  for (unsigned t = 0; t < n; ++t) c += static_cast<Count*>(data[t])->in != 0;
  for (unsigned t = 0; t < n; ++t) static_cast<Count*>(data[t])->out = c;
}
inline int block_count(int pred) {
  Count c{pred, 0};
  Block::self()->block_wait(&c, &run_count);
  return c.out;
}
inline unsigned block_threads() { return block_dim.x * block_dim.y * block_dim.z; }

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (PTX ISA's fragment layouts; g = lane / 4,
// t = lane % 4): A row g (+8 in a1, a3), columns 2t, 2t + 1 (+8 in a2, a3); B columns g, rows 2t,
// 2t + 1 (+8 in b1); C/D row g (+8 in c2, c3), columns 2t, 2t + 1. Each product is exact in fp32 and
// the 16 are summed in k order onto c (a GPU's tensor core sums in its own order: bits may differ).
struct Mma {
  uint32_t a[4], b[2];
  float c[4], d[4];
};
inline float bf16_lo(uint32_t v) { return from_bits<float>(uint64_t{v << 16}); }
inline float bf16_hi(uint32_t v) { return from_bits<float>(uint64_t{v & 0xffff0000u}); }
inline void run_mma(void** data, unsigned, unsigned) {
  float A[16][16], B[16][8], C[16][8];
  for (unsigned l = 0; l < 32; ++l) {
    const auto* m = static_cast<Mma*>(data[l]);
    const unsigned g = l / 4, t = l % 4;
    for (int i = 0; i < 4; ++i) {
      const unsigned row = g + (i & 1 ? 8 : 0), col = 2 * t + (i >= 2 ? 8 : 0);
      A[row][col] = bf16_lo(m->a[i]);
      A[row][col + 1] = bf16_hi(m->a[i]);
    }
    for (int i = 0; i < 2; ++i) {
      B[2 * t + 8 * i][g] = bf16_lo(m->b[i]);
      B[2 * t + 8 * i + 1][g] = bf16_hi(m->b[i]);
    }
    for (int i = 0; i < 4; ++i) C[g + (i >= 2 ? 8 : 0)][2 * t + (i & 1)] = m->c[i];
  }
  for (unsigned l = 0; l < 32; ++l) {
    auto* m = static_cast<Mma*>(data[l]);
    const unsigned g = l / 4, t = l % 4;
    for (int i = 0; i < 4; ++i) {
      const unsigned row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i & 1);
      float acc = C[row][col];
      for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
      m->d[i] = acc;
    }
  }
}
inline void mma_bf16_16816(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  Mma m;
  std::memcpy(m.a, a, sizeof(m.a));
  std::memcpy(m.b, b, sizeof(m.b));
  std::memcpy(m.c, c, sizeof(m.c));
  Block::self()->warp_wait(0xffffffffu, &m, &run_mma);  // (all 32 lanes: .aligned)
  std::memcpy(c, m.d, sizeof(m.d));
}

}  // namespace emu

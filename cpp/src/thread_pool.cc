// The process-wide thread pool (see cpp/include/moespec/thread_pool.h for the contract).
//
// Protocol of one job: the caller (holding call_mutex_) publishes fn/n_tasks under mutex_, opens
// the job and bumps the generation; workers that notice (spinning on generation_seen_, or woken
// from the condition variable) join under mutex_ while the job is open, counting themselves in
// busy_workers_. Everyone claims task indices from next_task_ until they run out. The caller then
// closes the job under mutex_ (no later joins) and waits until busy_workers_ drops to 0, so no
// worker touches the job's fields once parallel_for returns.
#include "moespec/thread_pool.h"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>

#include "moespec/error.h"

namespace moespec {
namespace {

// How long an idle worker spins (watching for the next job) before it sleeps.
constexpr auto kSpinTime = std::chrono::microseconds(50);

thread_local bool tls_inside_task = false;  // this thread runs a task (or is a worker)

struct InsideTask {
  bool saved = tls_inside_task;
  InsideTask() { tls_inside_task = true; }
  ~InsideTask() { tls_inside_task = saved; }
};

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

int threads_from_env() {
  const char* env = std::getenv("MOESPEC_NUM_THREADS");
  if (env != nullptr && *env != '\0') {
    char* end = nullptr;
    const long n = std::strtol(env, &end, 10);
    MOESPEC_CHECK_ARG(*end == '\0' && n >= 1 && n <= ThreadPool::kMaxThreads, "MOESPEC_NUM_THREADS",
                      "expected an integer in [1, ", ThreadPool::kMaxThreads, "], got '", std::string(env), "'");
    return static_cast<int>(n);
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(std::min<unsigned>(hw, ThreadPool::kMaxThreads));
}

ThreadPool* g_pool = nullptr;

}  // namespace

ThreadPool& ThreadPool::instance() {
  static ThreadPool* pool = [] {
    auto* p = new ThreadPool(threads_from_env());
    g_pool = p;
    pthread_atfork(nullptr, nullptr, &ThreadPool::after_fork_in_child);
    return p;
  }();
  return *pool;
}

void ThreadPool::after_fork_in_child() {
  // The child has only the forking thread: the workers are gone and any mutex may be held by a
  // thread that no longer exists. From now on every job runs inline, touching no shared state.
  if (g_pool != nullptr) g_pool->forked_.store(true, std::memory_order_relaxed);
}

ThreadPool::ThreadPool(int n) {
  start_workers(n - 1);
  num_threads_.store(n, std::memory_order_relaxed);
}

void ThreadPool::start_workers(int n_workers) {
  uint64_t generation;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    generation = generation_;
  }
  workers_.reserve(static_cast<std::size_t>(n_workers));
  // A worker starts from the generation current now, so it joins a job posted before it runs.
  for (int i = 0; i < n_workers; ++i) workers_.emplace_back([this, generation] { worker_loop(generation); });
}

void ThreadPool::stop_workers() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
    ++generation_;
    generation_seen_.store(generation_, std::memory_order_release);
  }
  wake_.notify_all();
  for (std::thread& t : workers_) t.join();
  workers_.clear();
  std::lock_guard<std::mutex> lock(mutex_);
  stop_ = false;
}

void ThreadPool::set_num_threads(int n) {
  MOESPEC_CHECK_ARG(n >= 1 && n <= kMaxThreads, "num_threads", "expected an integer in [1, ", kMaxThreads, "], got ",
                    n);
  if (tls_inside_task) throw_runtime("set_num_threads cannot be called from inside a parallel_for task");
  if (forked_.load(std::memory_order_relaxed)) {  // inline only; remember the number for num_threads()
    num_threads_.store(n, std::memory_order_relaxed);
    return;
  }
  std::lock_guard<std::mutex> call(call_mutex_);
  if (n == num_threads()) return;
  stop_workers();
  start_workers(n - 1);
  num_threads_.store(n, std::memory_order_relaxed);
}

void ThreadPool::run_tasks(const std::function<void(int64_t)>& fn, int64_t n_tasks) {
  InsideTask inside;
  while (!failed_.load(std::memory_order_relaxed)) {
    const int64_t i = next_task_.fetch_add(1, std::memory_order_relaxed);
    if (i >= n_tasks) break;
    try {
      fn(i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex_);
      if (!error_) error_ = std::current_exception();
      failed_.store(true, std::memory_order_relaxed);
    }
  }
}

void ThreadPool::worker_loop(uint64_t seen) {
  tls_inside_task = true;  // a task's nested parallel_for runs inline
  for (;;) {
    const auto spin_end = std::chrono::steady_clock::now() + kSpinTime;
    for (int iter = 1; generation_seen_.load(std::memory_order_acquire) == seen; ++iter) {
      cpu_relax();
      if (iter % 64 == 0 && std::chrono::steady_clock::now() > spin_end) break;
    }
    std::unique_lock<std::mutex> lock(mutex_);
    while (generation_ == seen && !stop_) {
      ++sleepers_;
      wake_.wait(lock);
      --sleepers_;
    }
    if (stop_) return;
    seen = generation_;
    if (!open_) continue;  // woke after the job closed: nothing to do
    busy_workers_.fetch_add(1, std::memory_order_relaxed);
    const std::function<void(int64_t)>* fn = fn_;
    const int64_t n_tasks = n_tasks_;
    lock.unlock();
    run_tasks(*fn, n_tasks);
    busy_workers_.fetch_sub(1, std::memory_order_release);
  }
}

void ThreadPool::parallel_for(int64_t n_tasks, const std::function<void(int64_t)>& fn) {
  if (n_tasks <= 0) return;
  if (tls_inside_task || n_tasks == 1 || num_threads() == 1 || forked_.load(std::memory_order_relaxed)) {
    InsideTask inside;
    for (int64_t i = 0; i < n_tasks; ++i) fn(i);
    return;
  }
  std::lock_guard<std::mutex> call(call_mutex_);
  failed_.store(false, std::memory_order_relaxed);
  error_ = nullptr;
  next_task_.store(0, std::memory_order_relaxed);
  bool notify;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    fn_ = &fn;
    n_tasks_ = n_tasks;
    open_ = true;
    ++generation_;
    generation_seen_.store(generation_, std::memory_order_release);
    notify = sleepers_ > 0;
  }
  if (notify) wake_.notify_all();
  run_tasks(fn, n_tasks);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    open_ = false;
  }
  for (int iter = 1; busy_workers_.load(std::memory_order_acquire) != 0; ++iter) {
    if (iter < 4096) cpu_relax();
    else std::this_thread::yield();
  }
  if (error_) {
    std::exception_ptr error = error_;
    error_ = nullptr;
    std::rethrow_exception(error);
  }
}

}  // namespace moespec

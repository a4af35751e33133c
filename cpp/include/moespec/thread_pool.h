// ThreadPool: the process-wide pool the CPU kernels run their tasks on (moe_experts first).
//
// One pool per process, created on first use with MOESPEC_NUM_THREADS threads (default:
// std::thread::hardware_concurrency()), the calling thread included: n threads = the caller plus
// n - 1 workers. Workers spin briefly after a job, then sleep on a condition variable.
//
// parallel_for(n, fn) calls fn(i) once for every i in [0, n), tasks claimed dynamically (an atomic
// counter), and returns when all have returned. Which thread runs which task is unspecified, so a
// kernel that wants results independent of the thread count must make each task's result depend
// on its index only (moe_experts does).
//  - Exceptions: the first exception a task throws is rethrown in the caller once every running
//    task has returned; tasks not yet started when it was thrown are skipped. Never std::terminate.
//  - Concurrent callers (several Python threads): serialized; one job runs at a time.
//  - Nested calls (parallel_for from inside a task): run inline on the calling thread.
//  - After fork() the child runs every parallel_for inline (its copy of the pool has no workers).
//
// Tests: tests/cpp/test_thread_pool.cc (which also measures the per-call overhead).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace moespec {

class ThreadPool {
 public:
  // The process-wide pool (intentionally never destroyed: at exit its workers sleep, and joining
  // threads from a static destructor can hang in forked children or while another thread runs a job).
  // Throws InvalidArgument naming MOESPEC_NUM_THREADS if that variable is set but not an integer >= 1.
  static ThreadPool& instance();

  // Threads that run a job, the caller included (>= 1).
  int num_threads() const { return num_threads_.load(std::memory_order_relaxed); }

  // Stops the workers and starts n - 1 new ones; n in [1, kMaxThreads] (InvalidArgument otherwise).
  // Waits for a job in progress; throws Error(kRuntime) when called from inside a task.
  void set_num_threads(int n);

  // Calls fn(i) for every i in [0, n_tasks) on the pool's threads (see the file comment).
  void parallel_for(int64_t n_tasks, const std::function<void(int64_t)>& fn);

  static constexpr int kMaxThreads = 1024;

  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

 private:
  explicit ThreadPool(int n);
  ~ThreadPool() = default;

  void start_workers(int n_workers);
  void stop_workers();
  void worker_loop(uint64_t seen);  // seen: the last generation it need not run
  // Claims and runs tasks of the current job until none is left.
  void run_tasks(const std::function<void(int64_t)>& fn, int64_t n_tasks);
  static void after_fork_in_child();

  std::mutex call_mutex_;  // one job at a time (concurrent callers wait here)

  std::mutex mutex_;  // guards the job fields below and the sleep/wake protocol
  std::condition_variable wake_;
  uint64_t generation_ = 0;  // bumped for every job (and for a stop)
  bool open_ = false;        // workers may still join the current job
  bool stop_ = false;
  int sleepers_ = 0;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_tasks_ = 0;

  std::atomic<uint64_t> generation_seen_{0};  // generation_, for spinning workers
  std::atomic<int64_t> next_task_{0};
  std::atomic<int> busy_workers_{0};  // workers that joined the current job and have not left it
  std::atomic<bool> failed_{false};
  std::mutex error_mutex_;
  std::exception_ptr error_;

  std::atomic<int> num_threads_{1};
  std::vector<std::thread> workers_;
  std::atomic<bool> forked_{false};
};

}  // namespace moespec

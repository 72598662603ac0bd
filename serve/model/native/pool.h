// A fork-join pool for the forward's parallel phases: within a forward (a Hot scope) workers
// spin between phases, which come microseconds apart; outside one they sleep almost at once,
// leaving the cores to whatever the process does between steps (sampling, other runtimes'
// thread pools), and are woken by the next forward's first phase.
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include <immintrin.h>

namespace osd {

class Pool {
 public:
  // Leaked on purpose: its threads never exit, and a static destructor would wait on them.
  static Pool& get() {
    static Pool* pool = new Pool();
    return *pool;
  }

  class Hot {  // workers keep spinning between phases while one is alive
   public:
    Hot() { Pool::get().hot_.store(true, std::memory_order_relaxed); }
    ~Hot() { Pool::get().hot_.store(false, std::memory_order_relaxed); }
  };

  // fn(i, n) for i in [0, n) on n threads; the caller runs i = 0 and returns when all are done.
  template <class F>
  void run(int n, F&& fn) {
    if (n <= 1) {
      fn(0, 1);
      return;
    }
    ensure(n - 1);
    auto call = [](void* ctx, int i, int n) { (*static_cast<F*>(ctx))(i, n); };
    fn_ = call;
    ctx_ = &fn;
    active_ = n;
    // Every worker acknowledges every run, so none can wake late into the next one.
    remaining_.store(static_cast<int>(threads_.size()), std::memory_order_release);
    gen_.fetch_add(1, std::memory_order_release);
    if (sleepers_.load(std::memory_order_acquire) > 0) gen_.notify_all();
    fn(0, n);
    while (remaining_.load(std::memory_order_acquire) != 0) _mm_pause();
  }

 private:
  static constexpr int kSpins = 1 << 15;   // inside a forward: longer than any phase
  static constexpr int kColdSpins = 1 << 8;  // outside: about a microsecond

  void ensure(int workers) {
    while (static_cast<int>(threads_.size()) < workers) {
      const int id = static_cast<int>(threads_.size()) + 1;
      // The generation before this run's: a worker that starts late still takes the run.
      const uint32_t seen = gen_.load(std::memory_order_acquire);
      threads_.emplace_back([this, id, seen] { loop(id, seen); });
      threads_.back().detach();
    }
  }

  void loop(int id, uint32_t seen) {
    for (;;) {
      uint32_t g;
      int spins = 0;
      while ((g = gen_.load(std::memory_order_acquire)) == seen) {
        if (++spins < (hot_.load(std::memory_order_relaxed) ? kSpins : kColdSpins)) {
          _mm_pause();
        } else {
          sleepers_.fetch_add(1, std::memory_order_acq_rel);
          gen_.wait(seen, std::memory_order_acquire);
          sleepers_.fetch_sub(1, std::memory_order_acq_rel);
          spins = 0;
        }
      }
      seen = g;
      if (id < active_) fn_(ctx_, id, active_);
      remaining_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  std::vector<std::thread> threads_;
  std::atomic<uint32_t> gen_{0};
  std::atomic<int> remaining_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> hot_{false};
  void (*fn_)(void*, int, int) = nullptr;
  void* ctx_ = nullptr;
  int active_ = 0;
};

// [begin, end) of n items for worker i of `workers`: contiguous, sizes differing by at most one.
inline void split(int n, int i, int workers, int* begin, int* end) {
  *begin = static_cast<int>(static_cast<int64_t>(n) * i / workers);
  *end = static_cast<int>(static_cast<int64_t>(n) * (i + 1) / workers);
}

}  // namespace osd

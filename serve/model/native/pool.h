// The forward's threads. A phase is a count of items that every participant claims one at a
// time (the caller too), so a worker the OS has taken off its core (the HTTP ingress shares
// the cores) costs the phase at most the item it holds: the others take the rest. Within a
// forward (a Hot scope) workers spin between phases, which come microseconds apart; outside
// one they sleep almost at once, leaving the cores to what the process does between steps
// (sampling, other runtimes' thread pools), and the next forward's first phase wakes them.
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include <immintrin.h>
#include <sched.h>

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

  // fn(item, participant) for every item in [0, count), on up to `threads` threads (the caller
  // is participant 0); returns when every item is done.
  template <class F>
  void run(int threads, int count, F&& fn) {
    if (threads <= 1 || count <= 1) {
      for (int i = 0; i < count; ++i) fn(i, 0);
      return;
    }
    ensure(threads - 1);
    fn_ = [](void* ctx, int i, int who) { (*static_cast<F*>(ctx))(i, who); };
    ctx_ = &fn;
    count_.store(count, std::memory_order_relaxed);
    limit_.store(threads, std::memory_order_relaxed);
    const uint64_t gen = (word_.load(std::memory_order_relaxed) >> 32) + 1;
    // The phase opens (item 0 is next). A worker that misses it, falling asleep just as it
    // opens, only leaves its items to the others: nobody waits for a worker that has none.
    word_.store(gen << 32, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      wake_.fetch_add(1, std::memory_order_release);
      wake_.notify_all();
    }
    work(gen, 0);
    // Every item is claimed; each is done once no worker is inside the phase. (A count of
    // finished items, reset each phase, once took a late increment and waited forever.)
    for (int spins = 0; busy_.load(std::memory_order_seq_cst) != 0; spins = spins < kSpins ? spins + 1 : spins) {
      if (spins < kSpins) _mm_pause();
      else sched_yield();  // a worker holding an item is off its core: let it have ours
    }
  }

 private:
  static constexpr int kSpins = 1 << 14;     // inside a forward: longer than any phase
  static constexpr int kColdSpins = 1 << 8;  // outside: about a microsecond

  // Claim and run items of phase `gen` until none is left or the phase is over.
  void work(uint64_t gen, int who) {
    uint64_t w = word_.load(std::memory_order_seq_cst);
    for (;;) {
      if ((w >> 32) != gen) return;
      const int next = static_cast<int>(w & 0xFFFFFFFFu);
      if (next >= count_.load(std::memory_order_relaxed)) return;
      if (word_.compare_exchange_weak(w, w + 1, std::memory_order_seq_cst, std::memory_order_seq_cst)) {
        fn_(ctx_, next, who);
        w = word_.load(std::memory_order_seq_cst);
      }
    }
  }

  void ensure(int workers) {
    while (static_cast<int>(threads_.size()) < workers) {
      const int id = static_cast<int>(threads_.size()) + 1;
      threads_.emplace_back([this, id] { loop(id); });
      threads_.back().detach();
    }
  }

  void loop(int id) {
    uint64_t seen = 0;  // the last phase this worker took part in
    for (;;) {
      int spins = 0;
      for (;;) {
        const uint64_t w = word_.load(std::memory_order_acquire);
        const uint64_t gen = w >> 32;
        if (gen != seen) {
          seen = gen;
          // id < limit_: this phase wants this many threads; the claim itself checks the phase.
          // busy_ first: the caller then waits for this worker if it may still claim an item.
          if (id < limit_.load(std::memory_order_relaxed)) {
            busy_.fetch_add(1, std::memory_order_seq_cst);
            work(gen, id);
            busy_.fetch_sub(1, std::memory_order_seq_cst);
          }
          spins = 0;
          continue;
        }
        if (++spins < (hot_.load(std::memory_order_relaxed) ? kSpins : kColdSpins)) {
          _mm_pause();
          continue;
        }
        const uint32_t ticket = wake_.load(std::memory_order_acquire);
        sleepers_.fetch_add(1, std::memory_order_acq_rel);
        if ((word_.load(std::memory_order_acquire) >> 32) == seen) wake_.wait(ticket, std::memory_order_acquire);
        sleepers_.fetch_sub(1, std::memory_order_acq_rel);
        spins = 0;
      }
    }
  }

  std::vector<std::thread> threads_;
  std::atomic<uint64_t> word_{0};  // phase generation << 32 | the next unclaimed item
  std::atomic<int> busy_{0};  // workers inside work()
  std::atomic<uint32_t> wake_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> hot_{false};
  void (*fn_)(void*, int, int) = nullptr;
  void* ctx_ = nullptr;
  std::atomic<int> count_{0};
  std::atomic<int> limit_{0};
};

// [begin, end) of n items for part i of `parts`: contiguous, sizes differing by at most one.
inline void split(int n, int i, int parts, int* begin, int* end) {
  *begin = static_cast<int>(static_cast<int64_t>(n) * i / parts);
  *end = static_cast<int>(static_cast<int64_t>(n) * (i + 1) / parts);
}

}  // namespace osd

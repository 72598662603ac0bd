// The forward's threads. A phase is a count of items split into one contiguous share per
// participant (the caller too): each takes its own share's items in order, then helps with
// the others' shares, one item at a time. So in a quiet phase every thread streams one range
// of weights with no contended claims, and a worker the OS has taken off its core (the HTTP
// ingress shares the cores) costs the phase at most the item it holds: the others take the
// rest. Within a forward (a Hot scope) workers spin between phases, which come microseconds
// apart; outside one they sleep almost at once, leaving the cores to what the process does
// between steps (sampling, other runtimes' thread pools), and the next forward's first phase
// wakes them.
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>
#include <type_traits>
#include <vector>

#include <immintrin.h>
#include <sched.h>

namespace osd {

// [begin, end) of n items for part i of `parts`: contiguous, sizes differing by at most one.
inline void split(int n, int i, int parts, int* begin, int* end) {
  *begin = static_cast<int>(static_cast<int64_t>(n) * i / parts);
  *end = static_cast<int>(static_cast<int64_t>(n) * (i + 1) / parts);
}

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
  // is participant 0); returns when every item is done. Participant p first takes the items of
  // its own contiguous share, in order, then helps with the others' (stealing).
  template <class F>
  void run(int threads, int count, F&& fn) {
    threads = threads < kMaxThreads ? threads : kMaxThreads;
    if (threads <= 1 || count <= 1) {
      for (int i = 0; i < count; ++i) fn(i, 0);
      return;
    }
    ensure(threads - 1);
    for (int base = 0; base < count; base += kMaxItems) {  // in turns past what a slot counts
      struct Job {
        std::remove_reference_t<F>* fn;
        int base;
      } job{&fn, base};
      fn_ = [](void* ctx, int i, int who) {
        Job* j = static_cast<Job*>(ctx);
        (*j->fn)(j->base + i, who);
      };
      ctx_ = &job;
      phase(threads, count - base < kMaxItems ? count - base : kMaxItems);
    }
  }

 private:
  static constexpr int kSpins = 1 << 14;     // inside a forward: longer than any phase
  static constexpr int kColdSpins = 1 << 8;  // outside: about a microsecond
  static constexpr int kMaxThreads = 64;
  static constexpr int kItemBits = 20;  // a slot's next and end fields
  static constexpr int kMaxItems = (1 << kItemBits) - 1;
  static constexpr uint64_t kGenMask = (1u << 24) - 1;
  struct alignas(64) Slot {
    std::atomic<uint64_t> word{0};  // generation (24 bits) << 40 | next item << 20 | end (kItemBits each)
  };
  static uint64_t pack(uint64_t gen, int next, int end) {
    return gen << (2 * kItemBits) | static_cast<uint64_t>(next) << kItemBits | static_cast<uint64_t>(end);
  }

  // Opens a phase of `count` items for fn_/ctx_ and takes part in it; returns when all are done.
  void phase(int threads, int count) {
    limit_.store(threads, std::memory_order_relaxed);
    uint64_t gen = (gen_.load(std::memory_order_relaxed) + 1) & kGenMask;
    if (gen == 0) gen = 1;  // 0 is no phase: a worker that never saw one has seen 0
    for (int p = 0; p < threads; ++p) {
      int b, e;
      split(count, p, threads, &b, &e);
      slots_[p].word.store(pack(gen, b, e), std::memory_order_relaxed);
    }
    gen_.store(gen, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      wake_.fetch_add(1, std::memory_order_release);
      wake_.notify_all();
    }
    work(gen, 0, threads);
    // Every item is claimed; each is done once no worker is inside the phase. (A count of
    // finished items, reset each phase, once took a late increment and waited forever.)
    for (int spins = 0; busy_.load(std::memory_order_seq_cst) != 0; spins = spins < kSpins ? spins + 1 : spins) {
      if (spins < kSpins) _mm_pause();
      else sched_yield();  // a worker holding an item is off its core: let it have ours
    }
  }

  // Claim and run items of phase `gen`, from this participant's share first, until every
  // share is empty or the phase is over (a worker that woke late finds a newer generation).
  void work(uint64_t gen, int who, int parts) {
    for (int i = 0; i < parts; ++i) {
      std::atomic<uint64_t>& slot = slots_[(who + i) % parts].word;
      uint64_t w = slot.load(std::memory_order_seq_cst);
      for (;;) {
        if ((w >> (2 * kItemBits)) != gen) return;  // the phase is over
        const int next = static_cast<int>((w >> kItemBits) & kMaxItems), end = static_cast<int>(w & kMaxItems);
        if (next >= end) break;
        if (slot.compare_exchange_weak(w, w + (uint64_t{1} << kItemBits), std::memory_order_seq_cst,
                                       std::memory_order_seq_cst)) {
          fn_(ctx_, next, who);
          w = slot.load(std::memory_order_seq_cst);
        }
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
        const uint64_t gen = gen_.load(std::memory_order_acquire);
        if (gen != seen) {
          seen = gen;
          // id < limit_: this phase wants this many threads; the claim itself checks the phase.
          // busy_ first: the caller then waits for this worker if it may still claim an item.
          const int parts = limit_.load(std::memory_order_relaxed);
          if (id < parts) {
            busy_.fetch_add(1, std::memory_order_seq_cst);
            work(gen, id, parts);
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
        if (gen_.load(std::memory_order_acquire) == seen) wake_.wait(ticket, std::memory_order_acquire);
        sleepers_.fetch_sub(1, std::memory_order_acq_rel);
        spins = 0;
      }
    }
  }

  std::vector<std::thread> threads_;
  Slot slots_[kMaxThreads];
  std::atomic<uint64_t> gen_{0};  // the latest phase
  std::atomic<int> busy_{0};  // workers inside work()
  std::atomic<uint32_t> wake_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> hot_{false};
  void (*fn_)(void*, int, int) = nullptr;
  void* ctx_ = nullptr;
  std::atomic<int> limit_{0};
};

}  // namespace osd

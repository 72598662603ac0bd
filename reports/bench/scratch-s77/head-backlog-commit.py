"""Seconds a request's commits take while its head drafts nothing, over an answer of N tokens:
the backlog joined at every commit (before) against kept in pieces (serve/spec_decode/head/draft.py
HeadState, after). One thread, bf16 features of the target's three feature layers (1,728 columns),
one committed row a step, as at one request when the suffix draft takes every step."""
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
from serve.spec_decode.head.draft import commit_head, head_state  # noqa: E402

torch.set_num_threads(1)
WIDTH = 3 * 576


class Cache:
    length = 0

    def truncate(self, n):
        self.length = min(self.length, n)


class Seq:
    def __init__(self):
        self.dcache, self.draft_state = Cache(), {}


def before(n, rows):  # the commit of the previous stop: torch.cat of the whole backlog each step
    feats, start = None, 0
    for t in range(n):
        prev = rows[:0] if feats is None else feats
        feats = torch.cat([prev, rows[t:t + 1]])[0 - start:]
    return feats


def after(n, rows):
    seq = Seq()
    for t in range(n):
        commit_head(seq, base=t + 1, feats=rows[t:t + 1])
    return head_state(seq).feats  # read once, as the head's next proposal does


for n in (64, 512, 2048):
    rows = torch.randn(n, WIDTH).to(torch.bfloat16)
    assert torch.equal(before(n, rows), after(n, rows))
    t = {"before": [], "after": []}
    for _ in range(5):
        for name, fn in (("before", before), ("after", after)):
            t0 = time.perf_counter()
            fn(n, rows)
            t[name].append(time.perf_counter() - t0)
    b, a = statistics.median(t["before"]), statistics.median(t["after"])
    print(f"answer of {n:5d} tokens: commits {b * 1e3:8.2f} ms before, {a * 1e3:6.2f} ms after "
          f"({b / n * 1e6:6.1f} / {a / n * 1e6:5.1f} us a step)")

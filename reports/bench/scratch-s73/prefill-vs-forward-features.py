import time, torch
from infra.config import OSDConfig
from pipeline.teacher.served_forward import served_forward
cfg = OSDConfig()
fwd, line = served_forward(cfg); print(line)
r = fwd.runner; print("threads", getattr(r, "threads", None), "small_rows", getattr(r, "small_rows", None))
g = torch.Generator().manual_seed(0)
seqs = [torch.randint(0, 49152, (n,), generator=g) for n in (180, 250, 300, 220, 260, 240)]
cache = r.new_cache()
asked = (9, 19, 29)  # any layers; with the last
def t(fn):
    ts = []
    for rep in range(3):
        t0 = time.perf_counter()
        for s in seqs:
            cache.truncate(0)
            for b in range(0, s.numel(), 256):
                fn(s[b:b+256], cache)
        ts.append(time.perf_counter() - t0)
    return min(ts)
for rnd in range(2):
    a = t(lambda x, c: r.forward_features(x, c, asked))
    b = t(lambda x, c: r.prefill(x, c, asked))
    n = sum(s.numel() for s in seqs)
    print(f"with logits {a*1e3:.0f} ms ({n/a:.0f} tok/s), without {b*1e3:.0f} ms ({n/b:.0f} tok/s): {a/b:.2f}x")

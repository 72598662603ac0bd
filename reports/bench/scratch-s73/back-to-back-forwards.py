import time, statistics, torch, sys
from infra.config import OSDConfig
from infra.target import load_target
from serve.model.native_runner import NativeLlamaRunner
cfg = OSDConfig()
model = load_target(cfg.model.target, cfg.model, progress=False).model.to(torch.bfloat16).eval()
r = NativeLlamaRunner(model, 512, small_rows=0)
cache = r.new_cache()
g = torch.Generator().manual_seed(0)
r.forward(torch.randint(0, r.vocab_size, (256,), generator=g), cache)
tok = torch.randint(0, r.vocab_size, (1,), generator=g)
def run(n, pause):
    ts = []
    for _ in range(n):
        if pause: time.sleep(pause)
        t = time.perf_counter(); r.forward(tok, cache); ts.append((time.perf_counter() - t) * 1e3); cache.truncate(256)
    ts.sort(); return ts
for rnd in range(3):
    for pause in (0, 0.01):
        ts = run(200, pause)
        print(f"pause {pause}: min {ts[0]:.2f} p10 {ts[20]:.2f} p50 {ts[100]:.2f} p90 {ts[180]:.2f} ms", flush=True)

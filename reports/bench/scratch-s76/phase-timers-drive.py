import sys, time, statistics, torch
sys.path.insert(0, '/work/main')
from infra.config import OSDConfig
from infra.target import load_target
from serve.model.native_build import load_file
from serve.model.native_runner import NativeLlamaRunner
T = int(sys.argv[1]); lib = sys.argv[2]; n = int(sys.argv[3]) if len(sys.argv) > 3 else 200
cfg = OSDConfig()
model = load_target(cfg.model.target, cfg.model, progress=False).model.to(torch.bfloat16).eval()
r = NativeLlamaRunner(model, 512, small_rows=0, lib=load_file(lib))
cache = r.new_cache()
g = torch.Generator().manual_seed(0)
r.forward(torch.randint(0, r.vocab_size, (256,), generator=g), cache)
tok = torch.randint(0, r.vocab_size, (T,), generator=g)
ts = []
for _ in range(n):
    t = time.perf_counter(); r.forward(tok, cache); ts.append((time.perf_counter() - t) * 1e3); cache.truncate(256)
print(f"T={T} median {statistics.median(ts):.2f} ms min {min(ts):.2f}", file=sys.stderr)

import time, numpy as np, torch
from infra.config import OSDConfig
from infra.records.schema import Record
from pipeline.teacher.served_forward import served_forward
from train.online.served import served_features
cfg = OSDConfig()
fwd, line = served_forward(cfg); print(line)
rng = np.random.default_rng(0)
recs = []
for i, (p, o) in enumerate([(200, 64), (120, 64), (300, 64), (80, 64), (250, 64), (160, 64)]):
    recs.append(Record(request_id=f"r{i}", draft_version="x", prompt_ids=rng.integers(0, 49152, p).astype(np.int32),
                       output_ids=rng.integers(0, 49152, o).astype(np.int32), topk_ids=np.zeros((o, 1), np.int32),
                       topk_logprobs=np.zeros((o, 1), np.float32), accepted=np.zeros(o, bool), draft_tokens=0, draft_probs=None))
for rnd in range(3):
    out = []
    for g in ("all", "outputs", "none"):
        t = time.perf_counter(); served_features(fwd, recs, (9, 19, 28), 1024, greedy=g); out.append((g, time.perf_counter() - t))
    print("  ".join(f"{g} {s*1e3:.0f} ms" for g, s in out), f"| outputs {out[0][1]/out[1][1]:.2f}x, none {out[0][1]/out[2][1]:.2f}x", flush=True)

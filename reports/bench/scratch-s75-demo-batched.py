"""Scratch: the demo's batched check in-process: 12 speed prompts, 8 at a time, per-request tok/s;
each head with speculation vs off, rounds alternating; per-step drafting stats."""
import sys, json, asyncio, time, statistics
from infra.config import load_config
from infra.prompts import messages_ids
from pipeline.bench import batch as B
from serve.engine.core import EngineOptions, SpecEngine, GenerationParams
from serve.spec_decode.specs import build_draft
from infra.target import load_target
from pipeline.bench.engine import bench_model_config

heads = dict(a.split("=", 1) for a in sys.argv[1].split(","))
reps = int(sys.argv[2])
cfg = load_config()
mcfg = bench_model_config(cfg, "cpu", None, None, None)
loaded = load_target(mcfg.target, mcfg, progress=False)
serve = cfg.serve.model_copy(update={"max_concurrency": 8, "max_queue": 32})
first = next(iter(heads.values()))
eng = SpecEngine(loaded.model, build_draft(first, loaded.model, suffix=cfg.serve.suffix), loaded.tokenizer,
                 EngineOptions.from_config(serve, mcfg))
drafts = {n: eng.make_draft(build_draft(p, loaded.model, suffix=cfg.serve.suffix)) for n, p in heads.items()}
prompts = [json.loads(l)["prompt"] for l in open("reports/demo-s75-zen4/speed_prompts.jsonl")]
ids = [messages_ids(loaded.tokenizer, [{"role": "user", "content": p}]) for p in prompts]

async def level(params, draft):
    sem = asyncio.Semaphore(8)
    async def one(x):
        async with sem:
            t0 = time.perf_counter()
            stream = eng.stream(x, params, draft)
            async for _ in stream:
                pass
            r = stream.result
            return len(r.output_ids) / (time.perf_counter() - t0), r.stats, len(r.output_ids)
    return await asyncio.gather(*[one(x) for x in ids])

res = {}
for rep in range(reps):
    order = list(heads) if rep % 2 == 0 else list(heads)[::-1]
    for name in order:
        pair, wall = {}, {}
        for spec in ((True, False) if rep % 2 == 0 else (False, True)):
            params = GenerationParams(max_new_tokens=64, speculate=spec, capture=False,
                                      cache_salt=f"s-{rep}-{name}-{spec}")
            t0 = time.perf_counter()
            pair[spec] = asyncio.run(level(params, drafts[name] if spec else None))
            wall[spec] = time.perf_counter() - t0
        ratios = [a[0] / b[0] for a, b in zip(pair[True], pair[False])]
        st = [x[1] for x in pair[True]]
        drafted = sum(s.num_draft_tokens for s in st); acc = sum(s.num_accepted_tokens for s in st)
        steps = sum(s.num_steps for s in st)
        tp = {sp: sum(len_ for len_ in [64] * 0) for sp in pair}
        toks = {sp: sum(x[2] for x in pair[sp]) for sp in pair}
        thr = (toks[True] / wall[True]) / (toks[False] / wall[False])
        res.setdefault(name, []).append(thr)
        print(rep, name, f"throughput sd/ar {thr:.3f} (walls {wall[True]:.2f} {wall[False]:.2f} s)", f"median sd/ar {statistics.median(ratios):.3f}", f"drafted {drafted} accepted {acc} steps {steps}",
              f"sd tok/s med {statistics.median(a[0] for a in pair[True]):.1f} ar {statistics.median(b[0] for b in pair[False]):.1f}", flush=True)
for n, v in res.items():
    print(n, [round(x, 3) for x in v], "median", round(statistics.median(v), 3))
print("gate", json.dumps(eng.policy.gate.state() if hasattr(getattr(eng, 'policy', None), 'gate') else None))

import sys, time, collections, functools, argparse
sys.argv = ['x']
import serve.engine.step as step
import serve.engine.core as core
T = collections.Counter(); N = collections.Counter()
def timed(mod, name, label=None):
    f = getattr(mod, name)
    @functools.wraps(f)
    def w(*a, **k):
        t = time.perf_counter()
        try: return f(*a, **k)
        finally: T[label or name] += time.perf_counter() - t; N[label or name] += 1
    setattr(mod, name, w)
for n in ('propose_all', 'forward_batch', '_finish_chains', 'prefilled_chunk', 'end_prefill', 'take_prefixes', 'run_step'):
    timed(step, n)
orig_plan = core.SpecEngine.plan
def plan(self, *a, **k):
    t = time.perf_counter()
    try: return orig_plan(self, *a, **k)
    finally: T['plan'] += time.perf_counter() - t
core.SpecEngine.plan = plan
orig_once = core.SpecEngine.run_once
def run_once(self):
    t = time.perf_counter()
    try: return orig_once(self)
    finally: T['run_once'] += time.perf_counter() - t; N['run_once'] += 1
core.SpecEngine.run_once = run_once
from pipeline.bench import batch
from infra.config import load_config
cfg = load_config() if hasattr(sys.modules['infra.config'], 'load_config') else None
def go(spec_mode, draft, requests=6):
    T.clear(); N.clear()
    p = argparse.ArgumentParser(); batch.add_arguments(p)
    args = p.parse_args(['--clients', '8', '--requests', str(requests), '--speculation', spec_mode, '--draft', draft,
                         '--max-new-tokens', '64', '--prefix-reuse', 'on'])
    import io, contextlib
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        batch.run(load_config(), args)
    tok = [l for l in buf.getvalue().splitlines() if 'tok/s' in l and 'clients, spec' in l][0].split(':')[1].split(',')[0]
    n = N['forward_batch']
    print(f"{draft.split('/')[-1]:22s} {spec_mode:3s} {tok:>12s}  forward {T['forward_batch']*1e3/n:6.2f} ms x{n}  "
          f"python {(T['run_once']-T['forward_batch'])*1e3/n:5.2f} ms/step: propose {T['propose_all']*1e3/n:5.2f} "
          f"finish {T['_finish_chains']*1e3/n:5.2f} end_prefill {T['end_prefill']*1e3/n:5.2f} plan {T['plan']*1e3/n:5.2f}", flush=True)
import os
for draft in os.environ["DRAFTS"].split(','):
    for mode in ('on', 'off', 'off', 'on'):
        go(mode, draft)

"""Scratch: per-step log of an in-process batch bench, the gate forced to alternate blocks."""
import json, sys, os
import serve.engine.core as core
from serve.spec_decode import draft_gate as dg
LOG = []
ENG = []
orig = core.run_step
def logged(eng, plan):
    prompt = sum(t.numel() for _, t in plan.chunks)
    took = orig(eng, plan)
    ENG.append(eng)
    lp = eng._lengths
    dec = getattr(lp, "decided", None)
    drafted = sum(len(s.out) for s in plan.decode)
    LOG.append(dict(n=len(plan.decode), prompt=prompt, rows=took.rows, s=took.seconds, tokens=took.emitted + took.prompt_rows,
                    decided=list(dec) if dec else None))
    return took
core.run_step = logged
if os.environ.get("ALTERNATE"):
    def allow(self, sequences):
        b = self.buckets.setdefault(self.bucket(sequences), dg.Bucket(dg.Rate(), dg.Rate()))
        block = b.steps // dg.BLOCK; b.steps += 1
        return block % 2 == 0
    dg.DraftGate.allow = allow
if os.environ.get("PLAIN"):
    def allow(self, sequences):
        b = self.buckets.setdefault(self.bucket(sequences), dg.Bucket(dg.Rate(), dg.Rate()))
        b.steps += 1
        return False
    dg.DraftGate.allow = allow
from pipeline.cli import main
try:
    main(["bench", "batch"] + sys.argv[2:])
finally:
    json.dump(LOG, open(sys.argv[1], "w"))
    print('GATE', json.dumps(ENG[-1].gate_state()) if ENG else None)

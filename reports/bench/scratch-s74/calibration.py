"""Scratch: a head's confidence against its greedy agreement per depth (held-out code teacher
records of `osd bench adapt`'s state dir, the served int4 features). Usage: python calibration.py DIR..."""
import sys

import torch

from infra.config import load_config
from infra.drafts.layer import load_draft
from infra.target import load_target
from pipeline.bench.adapt_head import head_sets
from pipeline.teacher.engine import teacher_for
from pipeline.teacher.served_forward import served_forward
from train.distill.head import _batches, collate, windows
from train.online.served import served_features

cfg = load_config(overrides={"state_dir": "/tmp/adapt-state"})
loaded = load_target(cfg.model.target, cfg.model.for_training(), progress=False)
sets = head_sets(cfg, loaded, 48, 48, teacher_for(cfg))
forward, why = served_forward(cfg)
for d in sys.argv[1:]:
    head, _ = load_draft(d, loaded.model)
    head = head.float().eval()
    fs = served_features(forward, sets["held_code"], head.feature_layers, cfg.train.max_seq_len, greedy="outputs")
    conf, hit, n = [0.0] * 3, [0] * 3, [0] * 3
    bins = torch.zeros(3, 10, 2)
    with torch.no_grad():
        for group in _batches([x.numel() for x in fs.ids], 4096):
            b = collate(fs, group)
            first, rows = windows(b.valid, b.start, 0)
            states = head.unroll_windows(b.feats, b.next_ids, 3, first, rows.shape[1])
            t = b.valid.shape[1]
            at = rows.clamp(max=t - 1)
            real = b.valid.gather(1, at) & (rows < t)
            target = b.target_argmax.gather(1, at)
            for j, o in enumerate(states):
                m = real & (rows >= b.start.view(-1, 1) + j)
                q = torch.softmax(head.logits(o[m]).float(), -1)
                c, a = q.max(-1)
                ok = head.d2t[a] == target[m]
                conf[j] += float(c.sum()); hit[j] += int(ok.sum()); n[j] += int(m.sum())
                k = (c * 10).clamp(max=9.999).long()
                bins[j].index_put_((k, torch.zeros_like(k)), torch.ones_like(c), accumulate=True)
                bins[j].index_put_((k, torch.ones_like(k)), ok.float(), accumulate=True)
    print(d)
    for j in range(3):
        print(f"  depth {j + 1}: mean confidence {conf[j] / n[j]:.3f}, agreement {hit[j] / n[j]:.3f}, rows {n[j]}")
        print("    by confidence decile (rows, agreement): " + ", ".join(
            f"{i / 10:.1f}: {int(bins[j, i, 0])} {bins[j, i, 1] / max(bins[j, i, 0], 1):.2f}" for i in range(10)))

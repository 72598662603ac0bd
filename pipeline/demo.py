"""`make demo`: today it prepares the target and completes a few real ShareGPT prompts.

Later stages of the loop (serving, stream, trainer, canary) extend this entry point.
"""

from __future__ import annotations

import time

from pipeline.config import OSDConfig
from pipeline.prompts import chat_ids, load_sharegpt
from pipeline.target import load_target


def pick_demo_prompts(cfg: OSDConfig, n: int, max_chars: int = 300):
    """The first `n` short held-out prompts, in file order (so runs are comparable)."""
    held = [p for p in load_sharegpt(cfg.data, split="held_out") if len(p.text) <= max_chars]
    return held[:n]


def run_demo(cfg: OSDConfig, n_prompts: int, max_new_tokens: int) -> int:
    import torch

    print(f"== osd demo: target {cfg.model.target}", flush=True)
    loaded = load_target(cfg.model.target, cfg.model, progress=True)
    print(f"target loaded in {loaded.load_seconds:.2f} s", flush=True)
    tok, model = loaded.tokenizer, loaded.model
    prompts = pick_demo_prompts(cfg, n_prompts)
    print(f"{len(prompts)} held-out ShareGPT prompts, greedy, up to {max_new_tokens} new tokens\n", flush=True)
    for i, p in enumerate(prompts, 1):
        ids = torch.tensor([chat_ids(tok, p.text)], device=model.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )
        dt = time.perf_counter() - t0
        new = out[0, ids.shape[1]:]
        text = tok.decode(new, skip_special_tokens=True).strip()
        print(f"[{i}/{len(prompts)}] ({p.domain}, id {p.id}) {p.text.strip()[:160]!r}")
        print(f"  -> {text}")
        print(f"  ({len(new)} tokens in {dt:.2f} s, {len(new) / dt:.1f} tok/s)\n", flush=True)
    return 0

"""Builders the loop's tests share: a registry of tiny drafts for a replica to follow, and the
tiny target's own greedy records (what a trainer reads)."""

import random


def registry_for_replica(tiny, tmp_path, layers: tuple[int, ...], **serve):
    """(cfg, registry): versions v1, v2 ... one draft of the tiny target per entry of `layers`
    (its layer count), v1 stable, and a config whose replica follows the registry's aliases."""
    from infra.config import load_config
    from infra.drafts.layer import DraftSpec, build_draft, save_draft, target_ref
    from infra.registry import Registry

    cfg = load_config(environ={}, overrides={
        "state_dir": str(tmp_path), "model": {"target": "tiny-random"},
        "serve": {"draft": "registry", "record": False, **serve}})
    reg = Registry.from_config(cfg)
    for i, n in enumerate(layers, 1):
        spec = DraftSpec(num_layers=n)
        save_draft(build_draft(tiny.model, spec), spec, tmp_path / f"d{i}", target_ref=target_ref(tiny))
        reg.publish(tmp_path / f"d{i}", f"v{i}")
    reg.promote("v1")
    return cfg, reg


def greedy_records(n: int, prompt_len: int, max_new_tokens: int) -> list:
    """n records of the tiny target's greedy answers to seeded random prompts, with their top-8."""
    import torch

    from infra.records.schema import record_from_capture
    from infra.target import load_target
    from serve.engine.core import GenerationParams, SpecEngine
    from engine_options import small_options

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: per-op thread hand-off costs more than the math
    try:
        lt = load_target("tiny-random", progress=False)
        eng = SpecEngine(lt.model, None, lt.tokenizer, small_options(k=0, capture_top_k=8, max_seq_len=128))
        rng = random.Random(0)
        out = []
        for i in range(n):
            r = eng.generate([rng.randrange(256) for _ in range(prompt_len)], GenerationParams(max_new_tokens=max_new_tokens))
            out.append(record_from_capture(r.prompt_ids, r.output_ids, r.capture, request_id=f"r{i}",
                                           draft_version="teacher", domain="other"))
        return out
    finally:
        torch.set_num_threads(threads)

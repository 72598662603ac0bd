"""Training: the DeepSpeed distillation trainers that learn drafts from the record stream, and
the offline warm start that makes the first draft. Rooms, each importing only the ones below it
(pyproject.toml's import contract), and infra/:

    online/   the trainer actors on Ray that read the stream, step, checkpoint, gate and publish
              (trainer.py), what differs per draft family (family.py), the lag bound (lag.py),
              replay after a shift (replay.py), telemetry (metrics.py)
    warm/     `osd draft init`: the first layer draft (layer.py) and the first head (head.py)
    teacher/  the warm start's teacher: the target's own answers as records (data.py, batch.py),
              features captured with them (features.py), the on-disk cache (store.py), the
              train / held-out set (sets.py), progress (progress.py)
    gate/     judging a candidate: α_est on held-out records (evaluator.py) and the paired
              comparison with the stable draft (compare.py)
    distill/  how a draft learns from records: batches (batching.py), losses (losses.py), the
              objective (objective.py), the head's features and loss (head.py), the draft
              vocabulary (draft_vocab.py), and the one owner of DeepSpeed (ds_engine.py)

A record read from the stream (infra/records/) goes online/trainer.py -> distill/ (a step) ->
gate/ (the candidate judged) -> infra/registry.py (published for the rollout)."""

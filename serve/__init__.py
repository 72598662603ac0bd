"""Serving: an OpenAI-compatible endpoint on Ray Serve in front of target replicas, each running
the speculative decoding engine and writing what its target computed to the record stream.

Five rooms, each importing only the ones below it (pyproject.toml's import contract):

- `api/`: the HTTP side: the Ray Serve application and ingress, the OpenAI protocol and its
  parameters, chat templates, API keys, hot swap of draft versions, metrics, the ops page;
- `engine/`: one target's engine: the request's state, admission, the step (schedule, draft,
  execute, verify and commit), continuous batching, capture of what the target computed,
  detokenizing, tenancy;
- `spec_decode/`: the drafts: the one Draft protocol, the draft-length policy, and the families
  (a layer draft, the head, the suffix index and its hybrid, dynamic trees);
- `sampling/`: verification against the target and the logits processors, pure over tensors;
- `model/`: model execution: runners over a KV cache, linear formats (int4, int8), the batched
  forward, CUDA graphs, the native CPU forward.

A chat request goes api/app.py -> engine/core.py -> engine/scheduler.py -> engine/stages.py
(spec_decode/ proposes, model/ runs, sampling/verify.py accepts) -> engine/capture.py, whose
record the replica writes to the stream (infra/records/streams.py).
"""

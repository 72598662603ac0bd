"""The target's own outputs for a prompt set, as records, cached on disk.

Warm start for distillation: before live traffic exists, the target greedily answers a
prompt set and we keep, for every generated position, its top-k ids and log-probs, in the
same `infra.records.schema.Record` shape that serving captures.

- `generate_teacher_records`: batched greedy Hugging Face `generate` (left padding,
  attention mask, `output_logits=True`), the top-k of the raw logits' log_softmax taken per
  step on the whole [B, V] batch. Each sequence is cut after its first EOS (the EOS kept);
  pad positions are dropped. Or, given a `BatchGenerate` (the pipeline passes the serving
  engine's continuous batching, which `train` cannot import), that generator's answers.
  `generate_teacher_answers`: the same, plus the target features a `CapturingGenerate` took
  during generation (train/teacher/features.py), so the head's warm start needs no second pass.
- `records_to_table` / `table_to_records` / `content_digest`: the Arrow codec of the on-disk
  teacher cache (train/teacher/store.py: shards that grow across runs and resume).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Callable, Protocol, Sequence, Union, runtime_checkable

import numpy as np
import pyarrow as pa
import torch

from infra.prompts import Prompt, chat_ids
from infra.records.schema import SCHEMA_VERSION, Record, record_schema
from infra.records.tokens import eos_token_ids, topk_logprobs
from train.teacher.features import Answers, FeatureRows, TeacherDataError  # noqa: F401 (re-exported)

TEACHER_VERSION = "teacher"


# Told each finished answer's token count, in any order: a progress bar across calls.
OnAnswer = Callable[[int], None]
# What `generate_teacher_records` accepts as progress: a bar of its own (True), none, or a hook.
Progress = Union[bool, OnAnswer]


# (prompt ids per prompt, max_new_tokens, top_k, on_answer) -> per prompt, in order, the greedy
# answer's (output ids [N], top-k ids [N, k] int32, top-k log-probs [N, k] fp16) of the raw
# target distribution. `tag` names the generator in the cache key (dtypes give other answers).
class BatchGenerate(Protocol):
    tag: str

    def __call__(self, rows: list[list[int]], max_new_tokens: int, top_k: int,
                 on_answer: OnAnswer | None) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]: ...


# A BatchGenerate that can also capture the target features the head reads while it generates
# (the serving engine: pipeline/teacher/engine.py): per prompt, (the answer as BatchGenerate
# gives it, its feature rows of the head's `layers`: train/teacher/features.py).
@runtime_checkable
class CapturingGenerate(BatchGenerate, Protocol):
    def capture(self, rows: list[list[int]], max_new_tokens: int, top_k: int, on_answer: OnAnswer | None,
                layers: tuple[int, ...]) -> list[tuple[tuple[np.ndarray, np.ndarray, np.ndarray], FeatureRows]]: ...


class CacheCorrupt(RuntimeError):
    """A cache file is unreadable, truncated, altered, or belongs to another key."""


def _answer_hook(progress: Progress, prompts: int, max_new_tokens: int) -> tuple[OnAnswer | None, Any]:
    """(the hook to tell of each answer, a bar this call owns and must close, or None)."""
    if callable(progress):
        return progress, None
    if not progress:
        return None, None
    from train.teacher.progress import TokenProgress

    bar = TokenProgress(prompts, max_new_tokens)
    return bar.answer, bar


# ---------------------------------------------------------------- generation

def generate_teacher_records(target_model: Any, tokenizer: Any, prompts: Sequence[Prompt], **kw: Any) -> list[Record]:
    """Greedy answers of `target_model` to `prompts` (chat template), one Record each, in
    prompt order: generate_teacher_answers' records."""
    return generate_teacher_answers(target_model, tokenizer, prompts, **kw).records


def generate_teacher_answers(
    target_model: Any,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    *,
    max_new_tokens: int,
    top_k: int = 32,
    batch_size: int = 8,
    progress: Progress = True,
    eos_token_id: int | Sequence[int] | None = None,
    generate: BatchGenerate | None = None,
    feature_layers: tuple[int, ...] = (),
) -> Answers:
    """Greedy answers of `target_model` to `prompts` (chat template), one Record each, in
    prompt order. Prompts are batched by length (longest first) to limit padding.

    progress: True, a token bar of this call's own; False, none; a callable, told each
    finished answer's token count (the cache's bar across all its shards).
    eos_token_id: stop token(s); default the tokenizer's EOS, else the model's.
    generate: answer through this generator instead of Hugging Face `generate` (outside
    inference mode: the engine builds weights it later checks the versions of).
    feature_layers: where `generate` is a CapturingGenerate, also the features of these target
    layers captured during generation (Answers.features); else none are captured."""
    if max_new_tokens < 1 or top_k < 1 or batch_size < 1:
        raise TeacherDataError("max_new_tokens, top_k and batch_size must be >= 1")
    eos = eos_token_ids(tokenizer, getattr(target_model.generation_config, "eos_token_id", None),
                        explicit=eos_token_id)
    ids = _prompt_ids(target_model, tokenizer, prompts, max_new_tokens)
    on_answer, bar = _answer_hook(progress, len(prompts), max_new_tokens)
    try:
        if generate is None:
            return Answers(_hf_records(target_model, tokenizer, prompts, ids, max_new_tokens, top_k, batch_size,
                                       on_answer, eos))
        k = min(top_k, target_model.config.vocab_size)
        rows = None
        if feature_layers and isinstance(generate, CapturingGenerate):
            got = generate.capture(ids, max_new_tokens, k, on_answer, feature_layers)
            answers, rows = [a for a, _ in got], [f for _, f in got]
        else:
            answers = generate(ids, max_new_tokens, k, on_answer)
        cut = [_through_eos(a, set(eos)) for a in answers]
        records = [_record(p, x, *c) for p, x, c in zip(prompts, ids, cut)]
        if rows is None:
            return Answers(records)
        return Answers(records, [f.cut(len(x) + len(c[0])) for f, x, c in zip(rows, ids, cut)], tuple(feature_layers))
    finally:
        if bar is not None:
            bar.close()


def _hf_records(target_model: Any, tokenizer: Any, prompts: Sequence[Prompt], ids: list[list[int]],
                max_new_tokens: int, top_k: int, batch_size: int, on_answer: OnAnswer | None,
                eos: list[int]) -> list[Record]:
    from transformers import GenerationConfig

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else None)
    if pad is None:
        raise TeacherDataError("the tokenizer has no pad token and there is no EOS to pad with")
    k = min(top_k, target_model.config.vocab_size)
    gen_cfg = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
        eos_token_id=eos or None, pad_token_id=pad,
        output_logits=True, return_dict_in_generate=True,
    )
    order = sorted(range(len(prompts)), key=lambda i: -len(ids[i]))
    out: list[Record | None] = [None] * len(prompts)
    eos_t = torch.tensor(eos or [-1], device=next(target_model.parameters()).device)
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        for i, rec in zip(batch, _generate_batch(target_model, gen_cfg, [ids[i] for i in batch],
                                                 [prompts[i] for i in batch], pad, eos_t, k)):
            out[i] = rec
            if on_answer is not None:
                on_answer(rec.n_positions)
    return out  # type: ignore[return-value]


def _prompt_ids(target_model: Any, tokenizer: Any, prompts: Sequence[Prompt], max_new_tokens: int) -> list[list[int]]:
    """Each prompt's chat-template ids; TeacherDataError if one plus max_new_tokens exceeds the context."""
    limit = getattr(target_model.config, "max_position_embeddings", None)
    ids = [chat_ids(tokenizer, p.text) for p in prompts]
    for p, x in zip(prompts, ids):
        if limit and len(x) + max_new_tokens > limit:
            raise TeacherDataError(f"prompt {p.id}: {len(x)} tokens + max_new_tokens {max_new_tokens} "
                                   f"exceeds the context of {limit}")
    return ids


def left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids [B, W], attention mask [B, W]) with every row right-aligned: generation
    appends after the last column, so all rows must end there."""
    width = max(len(r) for r in rows)
    inp = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for row, x in enumerate(rows):
        inp[row, width - len(x):] = torch.tensor(x)
        mask[row, width - len(x):] = 1
    return inp, mask


def _steps_topk(step_logits: Sequence[torch.Tensor], b: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids [B, T, k] int32 and log-probs [B, T, k] fp16 (on the CPU), from `generate`'s
    T raw logits blocks [B, V], one per step: the whole batch in one op per step."""
    top_ids = torch.empty((b, len(step_logits), k), dtype=torch.int32)
    top_lps = torch.empty((b, len(step_logits), k), dtype=torch.float16)
    for t, logits in enumerate(step_logits):
        idx, lps = topk_logprobs(logits.float(), k)
        top_ids[:, t] = idx.to(torch.int32).cpu()
        top_lps[:, t] = lps.to(torch.float16).cpu()
    return top_ids, top_lps


def _lengths_through_eos(gen: torch.Tensor, eos_t: torch.Tensor, steps: int) -> torch.Tensor:
    """[B] length of each generated row of `gen` [B, T]: through its first EOS (kept), else all steps."""
    is_eos = torch.isin(gen, eos_t)
    first_eos = is_eos.int().argmax(1) + 1  # argmax returns the first maximum
    return torch.where(is_eos.any(1), first_eos, torch.full_like(first_eos, steps))


def _through_eos(answer: tuple[np.ndarray, np.ndarray, np.ndarray],
                 eos: set[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An answer cut after its first EOS (kept), as `generate`'s rows are."""
    out, ids, lps = answer
    n = next((i + 1 for i, t in enumerate(out.tolist()) if t in eos), len(out))
    return out[:n], ids[:n], lps[:n]


def _record(p: Prompt, prompt_ids: list[int], out: np.ndarray, top_ids: np.ndarray, top_lps: np.ndarray) -> Record:
    n = len(out)
    return Record(
        request_id=str(p.id), draft_version=TEACHER_VERSION, domain=p.domain,
        prompt_ids=np.asarray(prompt_ids, dtype=np.int32), output_ids=np.asarray(out, dtype=np.int32),
        topk_ids=np.asarray(top_ids, dtype=np.int32), topk_logprobs=np.asarray(top_lps, dtype=np.float16),
        accepted=np.zeros(n, dtype=bool), draft_tokens=np.full(n, -1, dtype=np.int32),
        draft_probs=np.full(n, np.nan, dtype=np.float32),
    )


def _generate_batch(target_model: Any, gen_cfg: Any, rows: list[list[int]], prompts: list[Prompt], pad: int,
                    eos_t: torch.Tensor, k: int) -> list[Record]:
    """One batched greedy `generate` over `rows` (the prompts' ids), a Record per row."""
    device = next(target_model.parameters()).device
    inp, mask = left_pad(rows, pad)
    res = target_model.generate(input_ids=inp.to(device), attention_mask=mask.to(device),
                                generation_config=gen_cfg)
    gen = res.sequences[:, inp.shape[1]:]  # [B, T]
    top_ids, top_lps = _steps_topk(res.logits, len(rows), k)
    lengths = _lengths_through_eos(gen, eos_t, len(res.logits))
    gen_np, ids_np, lps_np = gen.to(torch.int32).cpu().numpy(), top_ids.numpy(), top_lps.numpy()
    out = []
    for row, (p, x) in enumerate(zip(prompts, rows)):
        n = int(lengths[row])
        out.append(_record(p, x, gen_np[row, :n].copy(), ids_np[row, :n].copy(), lps_np[row, :n].copy()))
    return out


# ---------------------------------------------------------------- records <-> table

def _list(arrays: list[np.ndarray], dtype: Any, k: int = 0) -> pa.Array:
    lens = np.fromiter((a.shape[0] for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    if offsets[-1] >= 2**31:
        raise TeacherDataError("too many positions for one cache table (2^31)")
    shape = (0, k) if k else (0,)
    values = np.concatenate([np.asarray(a, dtype=dtype) for a in arrays]) if arrays else np.empty(shape, dtype)
    flat = pa.array(values.reshape(-1))
    inner = pa.FixedSizeListArray.from_arrays(flat, k) if k else flat
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), inner)


def records_to_table(records: Sequence[Record]) -> pa.Table:
    """One row per record, in the record schema of their (common) top-k width."""
    k = records[0].top_k if records else 1
    if any(r.top_k != k for r in records):
        raise TeacherDataError(f"records of different top-k widths: {sorted({r.top_k for r in records})}")
    schema = record_schema(k)
    cols = [
        pa.array([r.record_id for r in records], pa.string()),
        pa.array([str(r.request_id) for r in records], pa.string()),
        pa.array([float(r.created_at) for r in records], pa.float64()),
        pa.array([str(r.draft_version) for r in records], pa.string()),
        pa.array([r.domain for r in records], pa.string()),
        _list([r.prompt_ids for r in records], np.int32),
        _list([r.output_ids for r in records], np.int32),
        _list([r.topk_ids for r in records], np.int32, k),
        _list([r.topk_logprobs for r in records], np.float16, k),
        _list([r.accepted for r in records], np.bool_),
        _list([r.draft_tokens for r in records], np.int32),
        _list([r.draft_probs for r in records], np.float32),
    ]
    return pa.Table.from_arrays(cols, schema=schema)


def _cells(col: pa.ChunkedArray, k: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(offsets [n+1], flat values) of a list column; offsets index into values."""
    arr = col.combine_chunks()
    offsets = arr.offsets.to_numpy().astype(np.int64)
    vals = arr.values
    if k:
        base = vals.offset
        vals = vals.values[base * k :]
        offsets = offsets * k
    flat = vals.to_numpy(zero_copy_only=False)
    return offsets, flat


def table_to_records(table: pa.Table) -> list[Record]:
    """Inverse of records_to_table; numeric arrays are views into the table's buffers."""
    k = table.schema.field("topk_ids").type.value_type.list_size
    if not table.schema.remove_metadata().equals(record_schema(k).remove_metadata()):
        raise CacheCorrupt(f"table schema is not the record schema: {table.schema}")
    n = table.num_rows
    for name in table.column_names:
        if name != "domain" and table.column(name).null_count:
            raise CacheCorrupt(f"column {name} has nulls")
    meta = {name: table.column(name).to_pylist() for name in ("record_id", "request_id", "created_at",
                                                               "draft_version", "domain")}
    lists = {name: _cells(table.column(name), k if name.startswith("topk_") else 0)
             for name in ("prompt_ids", "output_ids", "topk_ids", "topk_logprobs", "accepted",
                          "draft_tokens", "draft_probs")}
    out = []
    for i in range(n):
        def cell(name: str) -> np.ndarray:
            offs, flat = lists[name]
            return flat[offs[i] : offs[i + 1]]

        ids, lps = cell("topk_ids"), cell("topk_logprobs")
        out.append(Record(
            record_id=meta["record_id"][i], request_id=meta["request_id"][i],
            created_at=meta["created_at"][i], draft_version=meta["draft_version"][i],
            domain=meta["domain"][i], prompt_ids=cell("prompt_ids"), output_ids=cell("output_ids"),
            topk_ids=ids.reshape(-1, k), topk_logprobs=lps.reshape(-1, k), accepted=cell("accepted"),
            draft_tokens=cell("draft_tokens"), draft_probs=cell("draft_probs"), schema_version=SCHEMA_VERSION,
        ))
        if out[-1].output_ids.shape[0] != out[-1].topk_ids.shape[0]:
            raise CacheCorrupt(f"row {i}: {out[-1].output_ids.shape[0]} outputs, {out[-1].topk_ids.shape[0]} top-k rows")
    return out


def content_digest(table: pa.Table) -> str:
    """sha256 over the table's logical values (not its byte layout)."""
    h = hashlib.sha256()
    h.update(str(table.num_rows).encode())
    for name in table.column_names:
        col = table.column(name)
        h.update(b"\0" + name.encode() + b"\0")
        t = col.type
        if pa.types.is_string(t):
            h.update(json.dumps(col.to_pylist()).encode())
        elif pa.types.is_list(t):
            k = t.value_type.list_size if pa.types.is_fixed_size_list(t.value_type) else 0
            offsets, flat = _cells(col, k)
            h.update((offsets - offsets[0]).tobytes())
            h.update(np.ascontiguousarray(flat[offsets[0] : offsets[-1]]).view(np.uint8).tobytes()
                     if flat.dtype == np.bool_ else np.ascontiguousarray(flat[offsets[0] : offsets[-1]]).tobytes())
        else:
            h.update(np.ascontiguousarray(col.to_numpy()).tobytes())
    return h.hexdigest()


__all__ = [
    "BatchGenerate", "CacheCorrupt", "CapturingGenerate", "TeacherDataError", "content_digest",
    "generate_teacher_answers", "generate_teacher_records", "records_to_table", "table_to_records",
]

"""The on-disk teacher cache: the target's answers, kept per prompt, growing across runs.

A store is one directory per generation setting (target, generator, max_new_tokens, top-k),
named by the sha256 of the setting's canonical JSON. Its answers live in shards, one Arrow
IPC file per chunk of prompts generated together (`shard-<sha of the chunk's prompts>.arrow`,
the record schema of infra/records/schema.py). A shard is written to a temp name and renamed, so a
kill leaves whole shards only; a shard that is truncated or altered anyway (its content sha256
and prompt list are in its metadata) is logged, deleted, and its prompts generated again.

`fill(prompts, build)` keeps every answer it finds and generates the prompts it lacks in
prompt order, `shard_prompts` at a time, a shard each. So a larger prompt set later only adds
shards, and an interrupted run resumes at the first chunk it had not finished, making the same
shards an uninterrupted run makes. With a budget, no shard starts after it has run out.

A prompt is matched by id and by a hash of its text, so an edited prompt is answered again.
One writer per store at a time.

Where the generator captured the target features the head reads (the serving engine does, as
it generates: train/teacher/features.py), they are kept beside their shard in
`shard-<name>.features.pt`, bound to the shard's content sha256, and written before it, so a
kill leaves no shard with features of other answers; `fill(..., feature_layers=)` returns them.
A damaged features file is logged and deleted, and its answers fall back to a forward pass.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa
import torch

from infra.prompts import Prompt
from infra.records.schema import Record
from train.teacher.data import CacheCorrupt, OnAnswer, TeacherDataError, content_digest, records_to_table, \
    table_to_records
from train.teacher.features import Answers, FeatureRows, FeaturesCorrupt, check_rows, features_path, \
    features_payload, load_payload, rows_of_payload
from train.teacher.progress import TokenProgress

log = logging.getLogger("osd.teacher")

STORE_FORMAT = 2  # format 1 was one file per whole prompt set (train/teacher/data.py's TeacherCache)
_KIND = b"osd.teacher.kind"
_FORMAT = b"osd.teacher.format"
_KEY = b"osd.teacher.key"
_DIGEST = b"osd.teacher.content_sha256"
_PROMPTS = b"osd.teacher.prompts"

# (a chunk of prompts, told each finished answer's tokens) -> their records, in chunk order, or
# Answers: the records with the features the generator captured.
Build = Callable[[list[Prompt], OnAnswer], "Sequence[Record] | Answers"]


def canonical_json(obj: Any) -> str:
    try:
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TeacherDataError(f"cache key is not plain JSON: {e}") from None


def prompt_hash(p: Prompt) -> str:
    """What the answer depends on besides the setting: the prompt's text and conversation."""
    return hashlib.sha256(canonical_json([p.text, [list(m) for m in p.messages]]).encode()).hexdigest()[:16]


def record_digest(r: Record) -> str:
    """sha256 of what a teacher answer says; not its record id or write time, which differ per run."""
    h = hashlib.sha256(canonical_json([r.request_id, r.domain, r.draft_version]).encode())
    for a in (r.prompt_ids, r.output_ids, r.topk_ids, r.topk_logprobs):
        h.update(np.ascontiguousarray(a).tobytes() + b"\0")
    return h.hexdigest()


@dataclass
class Filled:
    """What `fill` returns: the answers the store now holds for the prompts, in prompt order
    (every prompt's unless the budget stopped it), and how many it generated this time."""

    records: list[Record]
    generated: int
    stopped_by_budget: bool
    # With fill(feature_layers=): per record, its captured feature rows of those layers, or
    # None where the store has none (generated without capture, or for other layers).
    features: list[FeatureRows | None] | None = None


class TeacherStore:
    """The answers of one generation setting `key_parts`, under root/<sha256 of the setting>."""

    def __init__(self, root: str | Path, key_parts: dict[str, Any], *, shard_prompts: int = 128,
                 features_on_disk: bool = True):
        if shard_prompts < 1:
            raise ValueError(f"shard_prompts must be >= 1, got {shard_prompts}")
        self.key_json = canonical_json(key_parts)
        self.key = hashlib.sha256(self.key_json.encode()).hexdigest()
        self.dir = Path(root).expanduser() / self.key
        self.shard_prompts = shard_prompts
        # False: captured features are returned by fill but never written (a GPU's tens of GB).
        self.features_on_disk = features_on_disk

    def shards(self) -> list[Path]:
        return sorted(self.dir.glob("shard-*.arrow"))

    # -- reading ----------------------------------------------------------------

    def load(self, wanted: set[tuple[str, str]] | None = None) -> dict[tuple[str, str], Record]:
        """(prompt id, prompt hash) -> record, from every whole shard that holds one of `wanted`
        (None: all); a damaged shard is deleted. Only the footer of the others is read."""
        out: dict[tuple[str, str], Record] = {}
        for path in self.shards():
            try:
                if wanted is not None and wanted.isdisjoint(map(tuple, _shard_footer(path)[0])):
                    continue
                entries = self._read_shard(path)
            except CacheCorrupt as e:
                log.warning("teacher cache shard %s is corrupt (%s); deleting it, its prompts are generated "
                            "again", path, e)
                path.unlink(missing_ok=True)
                continue
            out.update(entries)
        return out

    def cached(self, prompts: Sequence[Prompt]) -> list[Record]:
        """The stored answers to `prompts`, in prompt order, skipping those never generated."""
        keys = [(p.id, prompt_hash(p)) for p in prompts]
        have = self.load(set(keys))
        return [have[k] for k in keys if k in have]

    def load_features(self, wanted: set[tuple[str, str]] | None = None,
                      layers: tuple[int, ...] | None = None) -> dict[tuple[str, str], FeatureRows]:
        """(prompt id, prompt hash) -> the feature rows captured with its answer, from the
        features files of the shards holding one of `wanted` (None: all), captured for `layers`
        (None: any). A damaged file, or one of other answers than its shard's, is deleted."""
        out: dict[tuple[str, str], FeatureRows] = {}
        for path in self.shards():
            fpath = features_path(path)
            if not fpath.exists():
                continue
            try:
                prompts, digest = _shard_footer(path)
                if wanted is not None and wanted.isdisjoint(map(tuple, prompts)):
                    continue
                got_layers, rows = rows_of_payload(load_payload(fpath), key=self.key, shard_digest=digest,
                                                   prompts=prompts)
            except (CacheCorrupt, FeaturesCorrupt) as e:
                log.warning("teacher features %s are unusable (%s); deleting them, their answers' features "
                            "are computed again", fpath, e)
                fpath.unlink(missing_ok=True)
                continue
            if layers is None or got_layers == tuple(layers):
                out.update({(pid, ph): r for (pid, ph), r in zip(prompts, rows)})
        return out

    def digest(self) -> str:
        """sha256 over every stored answer's content and its captured features, in id order:
        equal for equal caches however their shards were laid out or when they were written."""
        h = hashlib.sha256()
        feats = self.load_features()
        for key, rec in sorted(self.load().items()):
            rows = [feats[key].digest()] if key in feats else []
            h.update(canonical_json([*key, record_digest(rec), *rows]).encode() + b"\n")
        return h.hexdigest()

    def _read_shard(self, path: Path) -> dict[tuple[str, str], Record]:
        try:
            with pa.OSFile(str(path), "rb") as f:
                table = pa.ipc.open_file(f).read_all()
            table.validate(full=True)
        except (pa.ArrowException, OSError, ValueError) as e:
            raise CacheCorrupt(f"unreadable Arrow file ({type(e).__name__}: {e})") from None
        meta = table.schema.metadata or {}
        if meta.get(_KIND) != b"teacher-shard" or meta.get(_FORMAT) != str(STORE_FORMAT).encode():
            raise CacheCorrupt(f"not a teacher shard of format {STORE_FORMAT}")
        if meta.get(_KEY) != self.key.encode():
            raise CacheCorrupt(f"shard of key {meta.get(_KEY, b'?').decode()[:16]}…, expected {self.key[:16]}…")
        if meta.get(_DIGEST) != content_digest(table).encode():
            raise CacheCorrupt("content sha256 differs from the one recorded at write time")
        try:
            prompts = json.loads(meta.get(_PROMPTS, b"null"))
            records = table_to_records(table)
        except (pa.ArrowException, ValueError, KeyError) as e:
            raise CacheCorrupt(f"rows do not decode: {e}") from None
        if not isinstance(prompts, list) or [p[0] for p in prompts] != [r.request_id for r in records]:
            raise CacheCorrupt("the prompt list does not match the rows")
        return {(pid, ph): r for (pid, ph), r in zip(prompts, records)}

    # -- writing ----------------------------------------------------------------

    def _write_shard(self, chunk: Sequence[Prompt], answers: Answers) -> Path:
        records = answers.records
        if [r.request_id for r in records] != [p.id for p in chunk]:
            raise TeacherDataError(f"the generator answered {[r.request_id for r in records][:4]}…, "
                                   f"not the chunk's prompts {[p.id for p in chunk][:4]}…")
        prompts = [[p.id, prompt_hash(p)] for p in chunk]
        name = hashlib.sha256(canonical_json(prompts).encode()).hexdigest()[:20]
        table = records_to_table(records)
        digest = content_digest(table)
        meta = {**(table.schema.metadata or {}), _KIND: b"teacher-shard", _FORMAT: str(STORE_FORMAT).encode(),
                _KEY: self.key.encode(), _DIGEST: digest.encode(), _PROMPTS: canonical_json(prompts).encode()}
        table = table.replace_schema_metadata(meta)
        path = self.dir / f"shard-{name}.arrow"
        if answers.features is not None:
            check_rows(records, answers.features)
        if answers.features is not None and self.features_on_disk:
            # first: a kill between the two leaves no shard with others' features
            payload = features_payload(answers.features, key=self.key, shard_digest=digest, prompts=prompts,
                                       layers=answers.layers)
            _atomic_write(features_path(path), lambda f: torch.save(payload, f))
        else:
            features_path(path).unlink(missing_ok=True)
        _atomic_write(path, lambda f: _write_ipc(f, table))
        key_file = self.dir / "key.json"
        if not key_file.exists():  # for a person looking at the directory: which setting this is
            _atomic_write(key_file, lambda f: f.write(self.key_json.encode()))
        return path

    # -- the entry point ----------------------------------------------------------

    def fill(self, prompts: Sequence[Prompt], build: Build, *, tokens_per_prompt: int,
             budget_s: float | None = None, clock: Callable[[], float] = time.monotonic,
             progress: bool = True, feature_layers: tuple[int, ...] | None = None) -> Filled:
        """Every prompt's answer, generating those the store lacks (module doc). budget_s:
        no shard starts once this many seconds of `clock` have passed since the call began.
        feature_layers: also return the features captured for these layers (Filled.features)."""
        if budget_s is not None and not budget_s > 0:
            raise ValueError(f"budget_s must be > 0, got {budget_s}")
        feature_layers = tuple(feature_layers) if feature_layers is not None else None
        wanted = {(p.id, prompt_hash(p)) for p in prompts}
        have = self.load(wanted)
        feats = self.load_features(wanted, feature_layers) if feature_layers is not None else {}
        missing = _missing(prompts, have)
        if len(missing) < len(prompts):
            log.info("teacher cache: %d of %d prompts already answered", len(prompts) - len(missing), len(prompts))
        bar = TokenProgress(len(missing), tokens_per_prompt, clock=clock, budget_s=budget_s,
                            show=progress and bool(missing))
        t0, generated, stopped = clock(), 0, False
        try:
            for start in range(0, len(missing), self.shard_prompts):
                if budget_s is not None and clock() - t0 >= budget_s:
                    stopped = True
                    break
                chunk = missing[start:start + self.shard_prompts]
                answers = _as_answers(build(chunk, bar.answer))
                self._write_shard(chunk, answers)
                keys = [(p.id, prompt_hash(p)) for p in chunk]
                have.update(zip(keys, answers.records))
                if answers.features is not None and feature_layers is not None and answers.layers == feature_layers:
                    feats.update(zip(keys, answers.features))
                generated += len(chunk)
        finally:
            bar.close()
        if stopped:  # a warning, so it shows without logging set up: the run trains on less
            log.warning("teacher generation stopped at its budget: %s; %d prompts left for a later run",
                        bar.summary(), len(missing) - generated)
        elif missing:
            log.info("teacher generation: %s", bar.summary())
        keys = [k for k in ((p.id, prompt_hash(p)) for p in prompts) if k in have]
        return Filled([have[k] for k in keys], generated, stopped,
                      [feats.get(k) for k in keys] if feature_layers is not None else None)


def _missing(prompts: Sequence[Prompt], have: dict[tuple[str, str], Record]) -> list[Prompt]:
    """The prompts without an answer, in prompt order, each once."""
    seen: set[tuple[str, str]] = set()
    out = []
    for p in prompts:
        k = (p.id, prompt_hash(p))
        if k not in have and k not in seen:
            seen.add(k)
            out.append(p)
    return out


def _as_answers(got: Sequence[Record] | Answers) -> Answers:
    return got if isinstance(got, Answers) else Answers(list(got))


def _shard_footer(path: Path) -> tuple[list, str]:
    """A shard's ([[prompt id, prompt hash], ...], content sha256) from its footer alone;
    CacheCorrupt if unreadable."""
    try:
        with pa.OSFile(str(path), "rb") as f:
            meta = pa.ipc.open_file(f).schema.metadata or {}
        prompts = json.loads(meta.get(_PROMPTS, b"null"))
    except (pa.ArrowException, OSError, ValueError) as e:
        raise CacheCorrupt(f"unreadable Arrow footer ({type(e).__name__}: {e})") from None
    if not isinstance(prompts, list) or not all(isinstance(p, list) and len(p) == 2 for p in prompts):
        raise CacheCorrupt("no prompt list in its metadata")
    return prompts, meta.get(_DIGEST, b"").decode()


def _write_ipc(f: Any, table: pa.Table) -> None:
    with pa.ipc.new_file(f, table.schema) as writer:
        writer.write_table(table)


def _atomic_write(path: Path, write: Callable[[Any], Any]) -> None:
    """Write through `write(file)` to a temp name beside `path`, fsync, rename: a kill leaves
    the old file or the new one, never a torn one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)

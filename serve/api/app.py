"""Ray Serve application: an OpenAI-compatible ingress in front of N target replicas.

    HTTP ──> OpenAIIngress (FastAPI: validation, auth, SSE) ──handle──> TargetReplica × N
                                                                     (SpecEngine + RecordProducer)

With one replica (serve.ingress auto) both live in one deployment, ReplicaIngress, and the
ingress calls the replica in its own process (serve/api/local_handle.py).

Each replica runs the speculative engine and, when a request finishes, submits one record
(prompt, output, the target's top-k per position) to the Redis stream. Submitting only
enqueues (see infra.records.streams.RecordProducer): serving never waits on, or fails because
of, the record path.

`build_app(cfg)` binds the deployments from the one config tree, so tests and `osd serve`
build the same application.
"""

# No `from __future__ import annotations` here: FastAPI must see the real `Request` type on
# the ingress methods to inject it.
import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from infra.config import OSDConfig
from infra.common.cpu import replica_threads
from infra.drafts.spec import REGISTRY_DRAFTS
from serve.api.openai_protocol import (
    SSE_DONE,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    IncrementalText,
    DetokenizeRequest,
    drafted_by_source,
    RECORD_HEADER,
    chat_logprobs,
    completion_logprobs,
    TokenizeRequest,
    chat_body,
    chat_chunk,
    completion_body,
    completion_chunk,
    new_id,
    openapi_with_bodies,
    osd_extension,
    parse_body,
    record_choice,
    parse_request,
    sse_error,
    usage_chunk,
)

MODEL_ALIAS = "osd"
MAX_BODY_BYTES = 1 << 20  # a request body over this gets 413 before it is parsed
log = logging.getLogger("ray.serve")


# ---------------------------------------------------------------- replica

class TargetReplica:
    """One target (+ draft) with its engine and record producer. A plain class: Serve wraps it."""

    def __init__(self, cfg_dict: dict[str, Any]):
        import torch

        from infra.records.streams import RecordProducer
        from infra.target import load_target
        from serve.spec_decode.specs import build_draft
        from serve.engine.core import EngineOptions, SpecEngine
        from serve.api.metrics import ServeMetrics

        self.cfg = cfg = OSDConfig.model_validate(cfg_dict)
        torch.set_num_threads(replica_threads(cfg.serve.forward_threads, cfg.serve.num_replicas,
                                              cfg.serve.num_cpus_per_replica))
        loaded = load_target(cfg.model.target, cfg.model, progress=False)
        self.tokenizer = loaded.tokenizer
        self._token_texts: dict[int, str] = {}
        self.target = loaded.model
        self.engine = SpecEngine(loaded.model, None, loaded.tokenizer, EngineOptions.from_config(cfg.serve, cfg.model))
        self.router = self._make_router(cfg, build_draft)
        self.producer = (RecordProducer(cfg.stream.redis_url, cfg.stream, spool_dir=spool_dir(cfg))
                         if cfg.stream.redis_url else None)
        self._warm_suffix(cfg)
        self.metrics = ServeMetrics()
        # A text this long cannot fit the context whatever it tokenizes to (no token decodes to
        # more characters than its raw vocab string), so it is refused without tokenizing.
        longest = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = self.engine.max_seq_len * max(longest, 1)
        # Running mean of admission-to-finish time: with the slot count, the rate requests
        # complete at, for Retry-After hints (time spent queued would inflate it under load).
        self.mean_service_s = 1.0
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # constructed outside Serve (unit use)
            self.replica_id = f"local-{os.getpid()}"

    # -- drafts: fixed, or registry versions that hot-swap (serve/api/hot_swap.py) -------

    def _make_router(self, cfg: OSDConfig, build_draft: Any) -> Any:
        from infra.registry import Registry, RegistryError
        from infra.target import identify_target
        from serve.spec_decode.specs import resolve_auto
        from serve.api.hot_swap import DraftRouter, Routing

        self.registry = Registry.from_config(cfg)
        # Every draft loaded here must have been made for this target (hot swap refuses others).
        self.target_sha256 = identify_target(cfg.model.target, cfg.model, self.target)
        log = lambda msg: print(f"[osd replica] {msg}", flush=True)  # noqa: E731
        self._suffix = None  # registry+suffix: the one index every version is served beside
        if cfg.serve.draft not in REGISTRY_DRAFTS:
            spec, why = resolve_auto(cfg)  # `osd serve` resolved it already; a cluster app may not have
            if spec != cfg.serve.draft:
                log(why)
            model = build_draft(spec, self.target, target_sha256=self.target_sha256, suffix=cfg.serve.suffix)
            initial = Routing(spec if model is not None else "none",
                              self.engine.make_draft(model) if model is not None else None)
            return DraftRouter(self._load_version, initial, log)
        initial = Routing("none", None)
        if cfg.serve.draft.endswith("+suffix"):
            from serve.spec_decode.suffix.draft import SuffixDraft

            self._suffix = SuffixDraft.from_config(cfg.serve.suffix, self.target.config.vocab_size)
            initial = Routing("suffix", self.engine.make_draft(self._suffix))
        router = DraftRouter(self._load_version, initial, log)
        alone = "the suffix draft alone" if self._suffix is not None else "autoregressively"
        try:
            aliases = self.registry.aliases()
        except RegistryError as e:  # a torn alias file: serve without a draft until a poll reads a good one
            log(f"{e}; serving {alone} until the aliases can be read")
        else:
            if aliases["stable"]:
                canary = aliases["canary"]
                if not router.apply(aliases["stable"]["version"], canary and canary["version"],
                                    canary["weight"] if canary else 0.0):
                    log(f"the stable draft could not be loaded; serving {alone} until the aliases move")
            else:
                log(f"no stable alias in {self.registry.uri}; serving {alone} until one is set")
        router.follow_aliases(self.registry.aliases, cfg.serve.alias_poll_s)
        return router

    def _warm_suffix(self, cfg: OSDConfig) -> None:
        """A suffix draft starts from the fleet's recent records in the stream (a best effort: a
        stream that cannot be read leaves the index empty, and serving goes on)."""
        from infra.records.streams import connect, recent_records
        from serve.spec_decode.suffix.draft import suffix_of, warm_from_records
        from serve.engine.tenancy import origin_of

        suffix = self._suffix or suffix_of(self.router.routing.stable_runner)
        if suffix is None or not cfg.stream.redis_url:
            return
        try:
            # The producer's user: under the chart's ACL it may not read, and the index then
            # learns from this replica's own traffic only (docs/data-governance.md, least privilege).
            records = recent_records(connect(cfg.stream.redis_url, cfg.stream, role="producer"), cfg.stream.stream,
                                     cfg.serve.suffix.max_tokens)
        except Exception as e:  # Redis down or slow: the index learns from this replica's own traffic
            print(f"[osd replica] suffix index not warmed from the stream: {e}", flush=True)
            return
        added = warm_from_records(suffix, records, lambda r: origin_of(cfg.serve, r.tenant, r.user, r.request_id))
        print(f"[osd replica] suffix index warmed from the stream: {len(records)} records, {added} tokens", flush=True)

    def _load_version(self, version: str) -> Any:
        # Digests checked first, and a version made for another target refused.
        model, _ = self.registry.load_draft(version, self.target, expect_target_sha256=self.target_sha256)
        if self._suffix is not None and hasattr(model, "d2t"):  # a head: served beside the kept index
            from serve.spec_decode.suffix.draft import WithSuffix

            model = WithSuffix(model, self._suffix)
        return self.engine.make_draft(model)

    def _pick(self, req: dict[str, Any]) -> tuple[str, Any]:
        if not req.get("speculate", True):
            return "none", None
        return self.router.pick(req["request_id"])  # made by the server: a client cannot pick its arm

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Serve's user_config: {"stable": id, "canary": id | None, "canary_weight": w} pins the
        versions (alias following stops). A version that fails to load is refused and the
        replica keeps its drafts; it never raises, so Serve does not restart the replica."""
        if not user_config or not user_config.get("stable"):
            return
        self.router.stop_following()
        self.router.apply(user_config["stable"], user_config.get("canary"), float(user_config.get("canary_weight", 0)))

    @property
    def draft_version(self) -> str:
        return self.router.routing.stable

    # -- request preparation --------------------------------------------------

    def _token_ids(self, req: dict[str, Any]) -> tuple[list[int], str]:
        from serve.api.chat_template import chat_prompt_ids
        from serve.engine.core import RequestError

        if req["kind"] == "chat":
            msgs = req["messages"]
            chars = sum(len(m["content"]) for m in msgs)
        else:
            msgs, chars = None, len(req["prompt"]) if isinstance(req["prompt"], str) else 0
        if chars > self.max_prompt_chars:
            raise RequestError(f"prompt of {chars} characters cannot fit the context of {self.engine.max_seq_len} "
                               f"tokens", code="context_length_exceeded")
        if msgs is not None:
            user_text = next((m["content"] for m in reversed(msgs) if m["role"] == "user"), "")
            return chat_prompt_ids(self.tokenizer, msgs, req.get("add_generation_prompt", True),
                                   req.get("continue_final_message", False)), user_text
        if isinstance(req["prompt"], str):
            special = req.get("add_special_tokens", False)
            return self.tokenizer.encode(req["prompt"], add_special_tokens=special), req["prompt"]
        return req["prompt"], ""

    async def _prepare(self, req: dict[str, Any]):
        from infra.prompts import domain_of
        from serve.engine.core import GenerationParams
        from serve.engine.tenancy import origin_of
        from serve.sampling.verify import SamplingParams

        # Tokenizing runs off the event loop, so a long prompt never stalls other requests.
        ids, user_text = await asyncio.to_thread(self._token_ids, req)
        # "record" is record_choice's (every client opt-out folded in); an unrecorded request
        # is not captured either, so its text never joins the replica's suffix index.
        record = self.cfg.serve.record if req.get("record") is None else bool(req["record"])
        record = record and self.producer is not None
        s = req["sampling"]
        # No max_tokens: what the context has left, up to the server's cap (as vLLM, which has no cap).
        remaining = self.engine.max_seq_len - len(ids)
        cap = self.cfg.serve.max_new_tokens
        params = GenerationParams(
            max_new_tokens=req["max_tokens"] or (min(cap, remaining) if remaining >= 1 else cap),
            sampling=SamplingParams(temperature=s["temperature"], top_k=max(s["top_k"], 0), top_p=s["top_p"],
                                    seed=s["seed"]),
            stop=tuple(req["stop"]),
            capture=record,
            speculate=req.get("speculate", True),
            # While a canary runs, both arms draft every step, so the controller gets served
            # acceptance to compare even where the cost rule would draft nothing.
            min_draft=1 if self.router.routing.canary is not None else 0,
            processors=_processors(req.get("processors")),
            ignore_eos=bool(req.get("ignore_eos")),
            stop_token_ids=tuple(req.get("stop_token_ids") or ()),
            logprobs=req.get("logprobs"),
            cache_salt=req.get("cache_salt"),
            origin=origin_of(self.cfg.serve, req.get("tenant"), req.get("user"), req["request_id"]),
        )
        return list(ids), params, (domain_of(user_text) if user_text else None), record

    def _finish(self, req: dict[str, Any], version: str, result: Any, domain: str | None, record: bool,
                t0: float) -> dict[str, Any]:
        from infra.records.schema import record_from_capture

        req_id = req["request_id"]
        record_id = None
        if record and result.capture is not None:
            rec = record_from_capture(result.prompt_ids, result.output_ids, result.capture, request_id=req_id,
                                      draft_version=version, domain=domain, target_sha256=self.target_sha256,
                                      tenant=req.get("tenant"), user=req.get("user"))
            if self.producer.submit(rec):
                record_id = rec.record_id
        now = time.perf_counter()
        latency = now - t0
        self.mean_service_s += 0.1 * (now - req.get("admitted_at", t0) - self.mean_service_s)
        self.metrics.observe(version, result, latency)
        self.metrics.sync_steps(self.engine.scheduler.log)
        self.metrics.sync_gate(self.engine.gate_state())
        self.metrics.roles(self.router.routing.stable, self.router.routing.canary)
        self._sync_record_metrics()
        st = result.stats
        return {
            "logprobs": (self._logprob_entries(result.output_ids, result.logprobs)
                         if result.logprobs is not None else None),
            "text": result.text or "",
            "finish_reason": result.finish_reason,
            "output_ids": result.output_ids,
            "usage": result.usage,
            "draft_version": version,
            "acceptance_rate": st.acceptance_rate,
            "mean_accepted_len": st.mean_accepted_len,
            "num_drafts": st.num_drafts,
            "num_draft_tokens": st.num_draft_tokens,
            "num_accepted_tokens": st.num_accepted_tokens,
            "drafted_by_source": drafted_by_source(st),
            "record_id": record_id,
            "replica": self.replica_id,
            "latency_s": latency,
        }

    def _logprob_entries(self, tokens: list[int],
                         logprobs: list[tuple[float, list[tuple[int, float]]]]) -> list[dict[str, Any]]:
        """The engine's log-probs of `tokens` as the ingress formats them, each token as its text:
        [{"token", "logprob", "top": [[token, logprob]...]}]."""
        text = self._token_text
        return [{"token": text(t), "logprob": lp, "top": [[text(i), v] for i, v in top]}
                for t, (lp, top) in zip(tokens, logprobs)]

    def _token_text(self, token: int) -> str:
        # Memoised: a response names up to capture_top_k + 1 tokens per position.
        got = self._token_texts.get(token)
        if got is None:
            got = self._token_texts[token] = self.tokenizer.decode([token])
        return got

    def _sync_record_metrics(self) -> None:
        if self.producer is not None:
            ps = self.producer.stats()
            self.metrics.sync_records(self.draft_version, ps.written, dict(ps.dropped), ps.replayed)

    def _error(self, e: Exception, req: dict[str, Any], version: str) -> dict[str, Any]:
        """Any failure of a request -> {"error": {...}} for the ingress to answer; never raises."""
        from serve.engine.admission import Overloaded, QueueTimeout, retry_after_s
        from serve.engine.core import RequestError

        if isinstance(e, RequestError):
            self.metrics.error(version, e.code or "invalid_request")
            return {"error": {"status": 400, "message": str(e), "code": e.code}}
        if isinstance(e, (Overloaded, QueueTimeout)):
            full = isinstance(e, Overloaded)
            self.metrics.error(version, "overloaded" if full else "queue_timeout")
            return {"error": {"status": 429 if full else 503, "message": f"server busy: {e}; retry later",
                              "type": "rate_limit_error" if full else "server_error",
                              "code": "overloaded" if full else "queue_timeout",
                              "retry_after": retry_after_s(self.engine.slots, self.mean_service_s)}}
        self.metrics.error(version, "internal")
        log.exception("request %s failed in replica %s", req.get("request_id"), self.replica_id)
        return {"error": {"status": 500, "type": "server_error", "code": "internal_error",
                          "message": f"internal error ({type(e).__name__}); request id {req.get('request_id')}"}}

    async def _admitted(self, req: dict[str, Any], draft: Any) -> tuple[Any, Any, str | None, bool]:
        """Validate, tokenize and wait for a KV slot; raises what _error maps."""
        ids, params, domain, record = await self._prepare(req)
        stream = self.engine.stream(ids, params, draft=draft)  # validates now, before any token
        await stream.admit()
        req["admitted_at"] = time.perf_counter()
        return stream, params, domain, record

    # -- entry points (called through the deployment handle) -------------------

    async def generate(self, req: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        version, draft = self._pick(req)  # fixed for this request's lifetime
        stream = None
        try:
            stream, _, domain, record = await self._admitted(req, draft)
            async for _ in stream:
                pass
            return self._finish(req, version, stream.result, domain, record, t0)
        except Exception as e:
            return self._error(e, req, version)
        finally:
            if stream is not None:
                stream.abandon()

    async def generate_stream(self, req: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """First item: {"error": ...} or {"started": True}; then {"text": delta}...; last {"done": result}
        (or {"error": ...} if the request fails after it started)."""
        t0 = time.perf_counter()
        version, draft = self._pick(req)
        stream = None
        try:
            try:
                stream, params, domain, record = await self._admitted(req, draft)
            except Exception as e:
                yield self._error(e, req, version)
                return
            yield {"started": True, "prompt_tokens": len(stream.prompt)}
            text = IncrementalText(self.tokenizer, params.stop)
            emitted = 0
            try:
                async for toks in stream:
                    item: dict[str, Any] = {"text": text.push(params.shown(toks)),
                                            "completion_tokens": emitted + len(toks)}
                    if params.logprobs is not None:  # this step's tokens' (the engine wrote them before yielding)
                        item["logprobs"] = self._logprob_entries(toks, stream.logprobs[emitted:emitted + len(toks)])
                    emitted += len(toks)
                    yield item
                result = stream.result
                yield {"text": text.finish(result.text or "")}
                yield {"done": self._finish(req, version, result, domain, record, t0)}
            except Exception as e:
                yield self._error(e, req, version)
        finally:
            if stream is not None:
                stream.abandon()

    def stats(self, recent: bool = False) -> dict[str, Any]:
        """recent: also this replica's last requests (for the ops page; large, so on request)."""
        from serve.spec_decode.suffix.draft import suffix_of

        self._sync_record_metrics()
        pool = self.engine.slots
        out: dict[str, Any] = {"replica": self.replica_id, "draft_version": self.draft_version,
                               "drafts": self.router.state(), "recording": self.producer is not None,
                               "slots": {"total": pool.total, "free": pool.free, "queued": pool.queued,
                                         "rejected": pool.rejected, "timed_out": pool.timed_out}}
        if self.producer is not None:
            ps = self.producer.stats()
            out.update(records_submitted=ps.submitted, records_written=ps.written,
                       records_dropped=ps.dropped_total, dropped_by_reason=dict(ps.dropped), queued=ps.queued,
                       redis_up=ps.redis_up, records_replayed=ps.replayed)
        else:
            out.update(records_submitted=0, records_written=0, records_dropped=0, dropped_by_reason={})
        out["batch"] = self.engine.scheduler.log.totals()  # target forwards, their requests and rows
        sched = self.engine.scheduler  # prompt tokens admitted, and those a slot held (serve/engine/prefix.py)
        out["prefix"] = {"prompt_tokens": sched.prompt_tokens, "cached_tokens": sched.cached_tokens}
        out["time"] = time.time()  # when these counters were read: the ingress keeps each replica's last
        out["by_source"] = self.metrics.source_table()  # drafting steps by who proposed
        out["draft_gate"] = self.engine.gate_state()  # batched steps that may draft against those that may not
        tuning = getattr(self.engine.target, "tuning", None)
        if tuning is not None:  # the native forward's ways, as measured at load (native_tuning.py)
            out["native"] = {"small_rows": self.engine.target.small_rows, "prefetch": tuning.prefetch,
                             "amx_rows": tuning.amx_rows, "one_row_ms": tuning.ms}
        suffix = suffix_of(self.router.routing.stable_runner)
        if suffix is not None:  # the suffix index: its size and how often it proposes
            out["suffix"] = suffix.stats()
            self.metrics.sync_suffix(out["suffix"])
        if recent:
            out["recent"] = self.metrics.recent.snapshot()
            out["batch_series"] = self.engine.scheduler.log.series()
        return out

    def forget(self, match: dict[str, str]) -> dict[str, Any]:
        """Remove from this replica's suffix indexes the outputs a deletion names (RecordMatch's
        fields); the ingress calls it on every replica it reaches."""
        from infra.records.match import RecordMatch
        from serve.spec_decode.suffix.draft import suffix_of

        suffixes = {id(s): s for s in map(suffix_of, self.router.runners()) if s is not None}
        removed = sum(s.forget(RecordMatch(**match).matches_owner) for s in suffixes.values())
        return {"replica": self.replica_id, "removed": removed}

    def check_health(self) -> None:
        """Serve calls this every health_check_period_s; raising makes Serve restart the replica."""
        self.engine.check_health(self.cfg.serve.stall_timeout_s)
        if self.producer is not None and not self.producer.alive:
            raise RuntimeError("the record producer's thread has died")
        self.router.check_health()

    def health(self) -> dict[str, Any]:
        """For /healthz: check_health's verdict plus what is served."""
        self.check_health()
        return {"status": "ok", "draft_version": self.draft_version}

    def tokenize(self, req: dict[str, Any]) -> dict[str, Any]:
        """For /tokenize: the ids a prompt or a conversation (chat template applied) becomes."""
        from serve.api.chat_template import chat_prompt_ids
        from serve.engine.core import RequestError

        try:
            if req.get("messages") is not None:
                ids = chat_prompt_ids(self.tokenizer, req["messages"], req["add_generation_prompt"],
                                      req["continue_final_message"])
            else:
                ids = self.tokenizer.encode(req["prompt"], add_special_tokens=req["add_special_tokens"])
        except RequestError as e:
            return {"error": {"status": 400, "message": str(e), "code": e.code}}
        out: dict[str, Any] = {"count": len(ids), "max_model_len": self.engine.max_seq_len, "tokens": list(ids)}
        if req.get("return_token_strs"):
            out["token_strs"] = self.tokenizer.convert_ids_to_tokens(list(ids))
        return out

    def detokenize(self, ids: list[int]) -> dict[str, Any]:
        """For /detokenize and completions' echo: the text of token ids (special tokens left out,
        as in every output)."""
        vocab = len(self.tokenizer)
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            return {"error": {"status": 400, "message": f"token id {bad} is outside the vocabulary (0..{vocab - 1})",
                              "code": None}}
        return {"prompt": self.tokenizer.decode(ids, skip_special_tokens=True)}

    def close(self) -> None:
        """Stop following aliases and flush the record producer (both idempotent)."""
        router = getattr(self, "router", None)
        if router is not None:
            router.stop_following()
        producer = getattr(self, "producer", None)
        if producer is not None:
            producer.close(timeout=2.0)

    def __del__(self) -> None:
        self.close()


def spool_dir(cfg: OSDConfig) -> Path | None:
    """Where a replica's record producer spools (None: stream.spool is off). One dir per stream,
    shared by the replicas of a node, so a restarted or a live one replays a killed one's."""
    if not cfg.stream.spool:
        return None
    return Path(cfg.state_dir) / "spool" / cfg.stream.stream.replace("/", "_")


def _processors(fields: dict[str, Any] | None) -> Any:
    """ProcessorParams from the ingress's JSON (absent: none; a caller inside the cluster may
    send a request without them)."""
    from serve.engine.core import RequestError
    from serve.sampling.processors import ProcessorParams

    if not fields:
        return ProcessorParams()
    try:
        return ProcessorParams(**{**fields, "logit_bias": tuple((int(t), float(b)) for t, b in fields["logit_bias"])})
    except ValueError as e:  # the ingress checks these bounds; a direct caller gets a 400 too
        raise RequestError(str(e)) from None


# ---------------------------------------------------------------- ingress

# The schema is served by our own route, behind the key like every route but /healthz.
api = FastAPI(title="osd: online speculative decoding", docs_url=None, redoc_url=None, openapi_url=None)


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown routes and methods answer in the OpenAI error form too."""
    err = APIError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)
    return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))


def _request_id(request: Request) -> str | None:
    rid = request.headers.get("x-request-id", "").strip()
    return rid[:128] if rid and rid.isprintable() else None


def _error_response(e: APIError) -> JSONResponse:
    headers = {"Retry-After": str(e.retry_after)} if e.retry_after else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def _replica_error(err: dict[str, Any]) -> APIError:
    return APIError(err["status"], err["message"], type_=err.get("type", "invalid_request_error"),
                    code=err.get("code"), retry_after=err.get("retry_after"))


@serve.ingress(api)
class OpenAIIngress:
    def __init__(self, replica: Any, cfg_dict: dict[str, Any], api_key: str | None = None):
        from serve.api.metrics import ServeMetrics

        from serve.engine.tenancy import KeyRing

        self.replica = replica
        self.cfg = OSDConfig.model_validate(cfg_dict)
        self.api_key = api_key or None
        self.keys = KeyRing(self.cfg.serve, self.api_key)
        self.model_id = self.cfg.model.target
        self.replica_stats: dict[str, dict[str, Any]] = {}
        self.metrics = ServeMetrics()
        from serve.api.ops.source import StreamPoller
        from serve.api.ops.routes import OpsRoutes

        self.ops = OpsRoutes(self.cfg, self.keys.ops_key, self._recent_stats)
        self.stream_poller = StreamPoller(self.cfg).start()

    # -- helpers ---------------------------------------------------------------

    def _auth(self, request: Request) -> Any:
        """The Caller (tenant, admin) the request's key names, or APIError(401)."""
        caller = self.keys.caller(request.headers.get("authorization", ""))
        if caller is None:
            raise APIError(401, "missing or wrong API key (send Authorization: Bearer <key>)",
                           type_="authentication_error", code="invalid_api_key")
        return caller

    def _admin(self, request: Request) -> Any:
        caller = self._auth(request)
        if not caller.admin:
            raise APIError(403, "this needs an admin key (serve.api_keys admin: true)", type_="permission_error",
                           code="forbidden")
        return caller

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_id, MODEL_ALIAS):
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.model_id!r}",
                           param="model", code="model_not_found")

    async def _body(self, request: Request) -> bytes:
        """The JSON body, at most MAX_BODY_BYTES of it (413 past that, unread)."""
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            # Also what keeps a web page from posting here: a JSON POST needs a CORS preflight,
            # which this server never grants.
            raise APIError(415, f"Content-Type must be application/json, got {ctype or 'none'!r}",
                           code="unsupported_media_type")
        limit = MAX_BODY_BYTES
        too_big = APIError(413, f"request body is over this server's limit of {limit} bytes",
                           code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    def _engine_request(self, req: Any, record_header: str | None = None, caller: Any = None) -> dict[str, Any]:
        from infra.config import DEFAULT_TENANT
        from serve.engine.tenancy import record_decision

        tenant = caller.tenant if caller is not None else DEFAULT_TENANT
        out: dict[str, Any] = {
            # Server-made: it also picks the canary arm, so a client cannot choose its arm.
            "request_id": new_id("req"),
            "tenant": tenant,
            "user": req.user[:256] if req.user else None,
            "sampling": {"temperature": req.temperature, "top_k": req.top_k, "top_p": req.top_p, "seed": req.seed},
            "stop": list(req.stop_list()),
            # The tenant's policy over the client's choice (serve/engine/tenancy.py): a plain yes or no.
            "record": record_decision(self.cfg.serve.record_policy(tenant),
                                      record_choice(req.osd_record, req.store, record_header)),
            "speculate": req.osd_speculate,
            "cache_salt": req.cache_salt,
            "processors": req.processors(),
            "ignore_eos": req.ignore_eos,
            "stop_token_ids": list(req.stop_token_ids or ()),
            "logprobs": req.top_logprobs_n(),
        }
        if isinstance(req, ChatCompletionRequest):
            out.update(kind="chat", messages=req.flat_messages(), max_tokens=req.token_budget(),
                       add_generation_prompt=req.add_generation_prompt,
                       continue_final_message=req.continue_final_message)
        else:
            out.update(kind="completion", prompt=req.prompt, max_tokens=req.max_tokens,
                       add_special_tokens=req.add_special_tokens)
        return out

    async def _guarded(self, request: Request, work: Any, admin: bool = False) -> Any:
        """Run a route: APIError -> its OpenAI error; anything else -> a logged, counted 500.
        admin: only an admin key may (403 for another key)."""
        from ray.serve.exceptions import BackPressureError

        try:
            request.state.caller = self._admin(request) if admin else self._auth(request)
            return await work()
        except APIError as e:
            return _error_response(e)
        except BackPressureError:
            self.metrics.error("", "overloaded")
            return _error_response(APIError(503, "server busy: every replica's queue is full; retry later",
                                            type_="server_error", code="overloaded", retry_after=1))
        except Exception:
            rid = _request_id(request) or "-"
            self.metrics.error("", "internal")
            log.exception("request %s to %s failed in the ingress", rid, request.url.path)
            return _error_response(APIError(500, f"internal error; request id {rid}", type_="server_error",
                                            code="internal_error"))

    async def _complete(self, request: Request, kind: type) -> Any:
        req = parse_request(kind, await self._body(request), self.cfg.serve.max_new_tokens,
                            self.cfg.serve.capture_top_k)
        self._check_model(req.model)
        ereq = self._engine_request(req, request.headers.get(RECORD_HEADER), request.state.caller)
        # completions' echo: the prompt's text first (token-id prompts are decoded by a replica).
        echo = await self._prompt_text(req.prompt) if isinstance(req, CompletionRequest) and req.echo else ""
        if req.stream:
            return await self._stream(ereq, req, echo)
        result = await self.replica.generate.remote(ereq)
        if "error" in result:
            raise _replica_error(result["error"])
        result["text"] = echo + result["text"]
        body = (chat_body if kind is ChatCompletionRequest else completion_body)(
            ereq["request_id"], self.model_id, result)
        return JSONResponse(body)

    async def _prompt_text(self, prompt: str | list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        out = await self.replica.detokenize.remote(prompt)
        if "error" in out:
            raise _replica_error(out["error"])
        return out["prompt"]

    async def _stream(self, ereq: dict[str, Any], req: Any, echo: str) -> Any:
        gen = self.replica.options(stream=True).generate_stream.remote(ereq)
        first = await gen.__anext__()
        if "error" in first:
            raise _replica_error(first["error"])
        return StreamingResponse(self._sse(gen, ereq, req, echo, first["prompt_tokens"]),
                                 media_type="text/event-stream")

    async def _sse(self, gen: Any, ereq: dict[str, Any], req: Any, echo: str,
                   prompt_tokens: int) -> AsyncIterator[str]:
        rid, created = ereq["request_id"], int(time.time())
        is_chat = isinstance(req, ChatCompletionRequest)
        completion_tokens = 0
        offset = len(echo)  # completions' text_offset of the next token

        def chunk(text: str | None, finish_reason: str | None = None, extra: dict[str, Any] | None = None,
                  delta: dict[str, Any] | None = None, logprobs: list[dict[str, Any]] | None = None) -> str:
            if req.continuous_usage():  # vLLM's running usage on every chunk
                extra = {**(extra or {}), "usage": {"prompt_tokens": prompt_tokens,
                                                    "completion_tokens": completion_tokens,
                                                    "total_tokens": prompt_tokens + completion_tokens}}
            if is_chat:
                delta = delta or ({"content": text} if text is not None else {})
                return chat_chunk(rid, self.model_id, created, delta, finish_reason, extra,
                                  chat_logprobs(logprobs) if logprobs else None)
            return completion_chunk(rid, self.model_id, created, text or "", finish_reason, extra,
                                    completion_logprobs(logprobs, offset) if logprobs else None)

        if is_chat:
            yield chunk(None, delta={"role": "assistant", "content": ""})
        if echo:
            yield chunk(echo)
        try:
            async for item in gen:
                if "text" in item:
                    completion_tokens = item.get("completion_tokens", completion_tokens)
                    # A step's log-probs ride with its text, or alone where the text is held back.
                    lps = item.get("logprobs")
                    if item["text"] or lps:
                        yield chunk(item["text"], logprobs=lps)
                        offset += sum(len(e["token"]) for e in lps or ())
                elif "done" in item:
                    result = item["done"]
                    completion_tokens = result["usage"]["completion_tokens"]
                    yield chunk(None, result["finish_reason"], extra={"osd": osd_extension(result)})
                    if req.include_usage():  # the spec's own chunk: no choices, only when asked
                        yield usage_chunk(rid, self.model_id, created, result["usage"], is_chat)
                elif "error" in item:  # failed after the 200 went out: an SSE error event, as OpenAI sends
                    yield sse_error(_replica_error(item["error"]))
        except Exception:  # the replica died mid-stream: say so in the stream, then end it
            self.metrics.error("", "internal")
            log.exception("stream %s failed in the ingress", rid)
            yield sse_error(APIError(500, f"internal error; request id {rid}", type_="server_error",
                                     code="internal_error"))
        finally:
            # A replica in this process (serve.ingress "replica") streams through a plain async
            # generator: a client that hangs up ends its request now, not when it is collected.
            close = getattr(gen, "aclose", None)
            if close is not None:
                await close()
        yield SSE_DONE

    async def _tokenize(self, request: Request) -> Any:
        req = parse_body(TokenizeRequest, await self._body(request))
        self._check_model(req.model)
        out = await self.replica.tokenize.remote({
            "prompt": req.prompt, "messages": req.flat_messages() if req.messages is not None else None,
            "add_special_tokens": req.add_special_tokens, "add_generation_prompt": req.add_generation_prompt,
            "continue_final_message": req.continue_final_message, "return_token_strs": req.return_token_strs})
        if "error" in out:
            raise _replica_error(out["error"])
        return out

    async def _detokenize(self, request: Request) -> Any:
        req = parse_body(DetokenizeRequest, await self._body(request))
        self._check_model(req.model)
        return {"prompt": await self._prompt_text(req.tokens)}

    def _model_card(self, model_id: str) -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": 0, "owned_by": "osd", "root": self.model_id}

    async def _stats(self) -> dict[str, Any]:
        """Record counters summed over the replicas seen (a few calls reach each replica)."""
        calls = [self.replica.stats.remote() for _ in range(3 * self.cfg.serve.num_replicas)]
        for s in await asyncio.gather(*calls):
            self.replica_stats[s["replica"]] = s
        reps = list(self.replica_stats.values())
        return {
            "records_written": sum(r["records_written"] for r in reps),
            "records_dropped": sum(r["records_dropped"] for r in reps),
            # Continuous batching, summed: output tokens / forwards is tokens per target forward.
            "target_forwards": sum(r.get("batch", {}).get("forwards", 0) for r in reps),
            "target_rows": sum(r.get("batch", {}).get("rows", 0) for r in reps),
            # Prompt tokens, and those taken from a slot's cache instead of computed.
            "prompt_tokens": sum(r.get("prefix", {}).get("prompt_tokens", 0) for r in reps),
            "cached_prompt_tokens": sum(r.get("prefix", {}).get("cached_tokens", 0) for r in reps),
            "replicas": reps,
        }

    async def _delete_records(self, request: Request) -> dict[str, Any]:
        """DELETE /v1/osd/records?tenant=|user=|request_id=: the matching records out of the
        stream, its dead letters and every reached replica's suffix indexes, then an audit entry."""
        from infra.records.deletion import audit_deletion, delete_from_stream
        from infra.records.match import RecordMatch

        q = request.query_params
        try:
            match = RecordMatch(tenant=q.get("tenant") or None, user=q.get("user") or None,
                                request_id=q.get("request_id") or None)
        except ValueError as e:
            raise APIError(400, str(e), param="tenant") from None
        deleted = await asyncio.to_thread(delete_from_stream, self.cfg, match) if self.cfg.stream.redis_url else None
        # Several calls reach each replica (as _stats does); the first removes, the rest find nothing.
        calls = [self.replica.forget.remote(match.as_dict()) for _ in range(3 * self.cfg.serve.num_replicas)]
        answers = await asyncio.gather(*calls)
        replicas = sorted({a["replica"] for a in answers})
        removed = sum(a["removed"] for a in answers)
        entry = await asyncio.to_thread(audit_deletion, self.cfg, match, deleted, "api",
                                        by=request.state.caller.tenant, suffix_removed=removed, replicas=replicas)
        return {"match": match.as_dict(), "deleted": entry["deleted"], "suffix_removed": removed,
                "replicas": replicas}

    async def _recent_stats(self) -> list[dict[str, Any]]:
        """Each replica's stats with its recent requests (a few calls reach each replica)."""
        calls = [self.replica.stats.remote(True) for _ in range(3 * self.cfg.serve.num_replicas)]
        return list({s["replica"]: s for s in await asyncio.gather(*calls)}.values())

    # -- routes ------------------------------------------------------------------

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Any:
        return await self._guarded(request, lambda: self._complete(request, CompletionRequest))

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Any:
        return await self._guarded(request, lambda: self._complete(request, ChatCompletionRequest))

    @api.get("/v1/models")
    async def models(self, request: Request) -> Any:
        async def listing() -> dict[str, Any]:
            return {"object": "list", "data": [self._model_card(self.model_id)]}

        return await self._guarded(request, listing)

    # `path`: a model id may hold slashes (a hub id such as org/name).
    @api.get("/v1/models/{model_id:path}")
    async def model(self, request: Request, model_id: str) -> Any:
        async def card() -> dict[str, Any]:
            self._check_model(model_id)
            return self._model_card(model_id)

        return await self._guarded(request, card)

    @api.post("/tokenize")
    async def tokenize(self, request: Request) -> Any:
        return await self._guarded(request, lambda: self._tokenize(request))

    @api.post("/detokenize")
    async def detokenize(self, request: Request) -> Any:
        return await self._guarded(request, lambda: self._detokenize(request))

    @api.get("/version")
    async def version(self, request: Request) -> Any:
        async def version() -> dict[str, Any]:
            from importlib.metadata import version

            return {"version": version("osd-platform")}

        return await self._guarded(request, version)

    @api.get("/health", include_in_schema=False)
    async def health(self) -> Any:
        """vLLM's name for /healthz (guidellm checks it before a run); open like it, and out of
        the schema as an alias."""
        return await self.healthz()

    @api.get("/healthz")
    async def healthz(self) -> Any:
        """200 while a replica answers and passes its own health check (no stalled request,
        live producer and alias poller, slots adding up); 503 otherwise."""
        try:
            return await asyncio.wait_for(self.replica.health.remote(), timeout=10)
        except Exception as e:
            return JSONResponse({"status": "unhealthy", "error": f"{type(e).__name__}: {e}"[:500]}, status_code=503)

    @api.get("/osd/stats")
    async def osd_stats(self, request: Request) -> Any:
        # Every tenant's figures together: an admin's to read.
        return await self._guarded(request, self._stats, admin=True)

    @api.delete("/v1/osd/records")
    async def delete_records(self, request: Request) -> Any:
        return await self._guarded(request, lambda: self._delete_records(request), admin=True)

    # The ops page (serve/api/ops/routes.py): its own auth, so a browser can sign in with a cookie.
    @api.get("/ops", include_in_schema=False)
    async def ops_page(self, request: Request) -> Any:
        return await self.ops.page(request)

    @api.get("/ops/fragment", include_in_schema=False)
    async def ops_fragment(self, request: Request) -> Any:
        return await self.ops.fragment(request)

    @api.get("/ops/api/summary", include_in_schema=False)
    async def ops_summary(self, request: Request) -> Any:
        return await self.ops.api_summary(request)

    @api.get("/ops/login", include_in_schema=False)
    async def ops_login_form(self, request: Request) -> Any:
        return await self.ops.login_form(request)

    @api.post("/ops/login", include_in_schema=False)
    async def ops_login(self, request: Request) -> Any:
        return await self.ops.login(request)

    @api.post("/ops/logout", include_in_schema=False)
    async def ops_logout(self, request: Request) -> Any:
        return await self.ops.logout(request)

    @api.get("/openapi.json", include_in_schema=False)
    async def openapi(self, request: Request) -> Any:
        async def schema() -> dict[str, Any]:
            return openapi_with_bodies(api.openapi())

        return await self._guarded(request, schema)


class ReplicaIngress(OpenAIIngress):
    """The OpenAI routes and the lone target replica in one deployment (serve.ingress "replica"):
    the ingress calls the replica in its own process (serve/api/local_handle.py), and Serve's
    replica hooks (health, user_config, shutdown) reach the target."""

    async def __init__(self, cfg_dict: dict[str, Any], api_key: str | None = None):  # Serve's ingress wrapper's is async
        from serve.api.local_handle import LocalHandle

        self.target = TargetReplica(cfg_dict)
        await super().__init__(LocalHandle(self.target), cfg_dict, api_key)

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        self.target.reconfigure(user_config)

    def check_health(self) -> None:
        self.target.check_health()

    async def __del__(self) -> None:
        target = getattr(self, "target", None)
        if target is not None:
            target.close()
        await super().__del__()


def build_app(cfg: OSDConfig, api_key: str | None = None) -> Any:
    """The Serve application for this config: ingress bound to N target replicas, or, with
    serve.ingress "replica" (auto for one replica), one deployment holding both."""
    cfg_dict = cfg.model_dump(mode="json")
    sv = cfg.serve
    key = api_key if api_key is not None else os.environ.get("OSD_API_KEY")
    target = {"ray_actor_options": {"num_cpus": sv.num_cpus_per_replica}, "health_check_period_s": 10}
    if sv.ingress_in_replica:
        # Named as the replica it is: the chart's deployment options, the chaos tests and
        # `osd bench soak` find the target's process by this name.
        both = serve.deployment(ReplicaIngress, name="TargetReplica").options(
            num_replicas=1, **target,
            # The replica's admission answers 429/503 past its slots and queue (in the OpenAI
            # form), so Serve's own limit only has to stay out of its way.
            max_ongoing_requests=1000)
        return both.bind(cfg_dict, key)
    replica = serve.deployment(TargetReplica, name="TargetReplica").options(
        num_replicas=sv.num_replicas, **target,
        # Room for every slot and queue place, plus headroom so health and stats calls (and
        # the instant 429s past the queue) are never stuck behind a full replica.
        max_ongoing_requests=sv.max_concurrency + sv.max_queue + 16,
        # Past this many waiting at the handle, calls fail at once (BackPressureError -> 503).
        max_queued_requests=4 * (sv.max_concurrency + sv.max_queue) * sv.num_replicas,
    )
    ingress = serve.deployment(OpenAIIngress, name="OpenAIIngress").options(
        num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
    return ingress.bind(replica.bind(cfg_dict), cfg_dict, key)

"""Ray Serve application: an OpenAI-compatible ingress in front of N target replicas.

    HTTP ──> OpenAIIngress (FastAPI: validation, auth, SSE) ──handle──> TargetReplica × N
                                                                     (SpecEngine + RecordProducer)

Each replica runs the speculative engine and, when a request finishes, submits one record
(prompt, output, the target's top-k per position) to the Redis stream. Submitting only
enqueues (see pipeline.streams.RecordProducer): serving never waits on, or fails because
of, the record path.

`build_app(cfg)` binds the deployments from the one config tree, so tests and `osd serve`
build the same application.
"""

# No `from __future__ import annotations` here: FastAPI must see the real `Request` type on
# the ingress methods to inject it.
import asyncio
import os
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from pipeline.config import OSDConfig
from serve.openai_api import (
    SSE_DONE,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    IncrementalText,
    chat_body,
    chat_chunk,
    completion_body,
    new_id,
    osd_extension,
    parse_request,
)

MODEL_ALIAS = "osd"


# ---------------------------------------------------------------- replica

class TargetReplica:
    """One target (+ draft) with its engine and record producer. A plain class: Serve wraps it."""

    def __init__(self, cfg_dict: dict[str, Any]):
        import torch

        from pipeline.streams import RecordProducer
        from pipeline.target import load_target
        from serve.drafts import build_draft
        from serve.engine import EngineOptions, SpecEngine
        from serve.metrics import ServeMetrics

        self.cfg = cfg = OSDConfig.model_validate(cfg_dict)
        threads = cfg.model.num_threads or max(1, int(cfg.serve.num_cpus_per_replica))
        torch.set_num_threads(threads)
        loaded = load_target(cfg.model.target, cfg.model, progress=False)
        self.tokenizer = loaded.tokenizer
        self.target = loaded.model
        self.engine = SpecEngine(loaded.model, None, loaded.tokenizer, EngineOptions.from_config(cfg.serve))
        self.router = self._make_router(cfg, build_draft)
        self.producer = RecordProducer(cfg.stream.redis_url, cfg.stream) if cfg.stream.redis_url else None
        self.metrics = ServeMetrics()
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # constructed outside Serve (unit use)
            self.replica_id = f"local-{os.getpid()}"

    # -- drafts: fixed, or registry versions that hot-swap (serve/hot_swap.py) -------

    def _make_router(self, cfg: OSDConfig, build_draft: Any) -> Any:
        from pipeline.registry import Registry
        from serve.hot_swap import DraftRouter, Routing

        self.registry = Registry.from_config(cfg)
        log = lambda msg: print(f"[osd replica] {msg}", flush=True)  # noqa: E731
        if cfg.serve.draft != "registry":
            model = build_draft(cfg.serve.draft, self.target)
            initial = Routing(cfg.serve.draft if model is not None else "none",
                              self.engine.make_draft(model) if model is not None else None)
            return DraftRouter(self._load_version, initial, log)
        router = DraftRouter(self._load_version, Routing("none", None), log)
        aliases = self.registry.aliases()
        if aliases["stable"]:
            canary = aliases["canary"]
            if not router.apply(aliases["stable"]["version"], canary and canary["version"],
                                canary["weight"] if canary else 0.0):
                log("the stable draft could not be loaded; serving autoregressively until the aliases move")
        else:
            log(f"no stable alias in {self.registry.uri}; serving autoregressively until one is set")
        router.follow_aliases(self.registry.aliases, cfg.serve.alias_poll_s)
        return router

    def _load_version(self, version: str) -> Any:
        model, _ = self.registry.load_draft(version, self.target)  # digests checked first
        return self.engine.make_draft(model)

    def _pick(self, req: dict[str, Any]) -> tuple[str, Any]:
        if not req.get("speculate", True):
            return "none", None
        return self.router.pick(req.get("route_key") or req["request_id"])

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

    def _prepare(self, req: dict[str, Any]):
        from pipeline.prompts import domain_of, messages_ids
        from serve.engine import GenerationParams
        from serve.verify import SamplingParams

        if req["kind"] == "chat":
            msgs = req["messages"]
            ids = messages_ids(self.tokenizer, msgs)
            user_text = next((m["content"] for m in reversed(msgs) if m["role"] == "user"), "")
        elif isinstance(req["prompt"], str):
            ids = self.tokenizer.encode(req["prompt"], add_special_tokens=False)
            user_text = req["prompt"]
        else:
            ids, user_text = req["prompt"], ""
        record = self.cfg.serve.record if req.get("record") is None else bool(req["record"])
        record = record and self.producer is not None
        s = req["sampling"]
        params = GenerationParams(
            max_new_tokens=req["max_tokens"] or self.cfg.serve.max_new_tokens,
            sampling=SamplingParams(temperature=s["temperature"], top_k=max(s["top_k"], 0), top_p=s["top_p"],
                                    seed=s["seed"]),
            stop=tuple(req["stop"]),
            capture=record,
            speculate=req.get("speculate", True),
        )
        return list(ids), params, (domain_of(user_text) if user_text else None), record

    def _finish(self, req_id: str, version: str, result: Any, domain: str | None, record: bool,
                t0: float) -> dict[str, Any]:
        from pipeline.records import record_from_capture

        record_id = None
        if record and result.capture is not None:
            rec = record_from_capture(result.prompt_ids, result.output_ids, result.capture, request_id=req_id,
                                      draft_version=version, domain=domain)
            if self.producer.submit(rec):
                record_id = rec.record_id
        latency = time.perf_counter() - t0
        self.metrics.observe(version, result, latency)
        self._sync_record_metrics()
        st = result.stats
        return {
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
            "record_id": record_id,
            "replica": self.replica_id,
            "latency_s": latency,
        }

    def _sync_record_metrics(self) -> None:
        if self.producer is not None:
            ps = self.producer.stats()
            self.metrics.sync_records(self.draft_version, ps.written, dict(ps.dropped))

    def _error(self, e: Exception) -> dict[str, Any]:
        from serve.engine import RequestError

        if isinstance(e, RequestError):
            code = "context_length_exceeded" if "context" in str(e) else None
            self.metrics.error(self.draft_version, code or "invalid_request")
            return {"error": {"status": 400, "message": str(e), "code": code}}
        raise e

    # -- entry points (called through the deployment handle) -------------------

    async def generate(self, req: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        version, draft = self._pick(req)  # fixed for this request's lifetime
        try:
            ids, params, domain, record = self._prepare(req)
            stream = self.engine.stream(ids, params, draft=draft)  # validates now, before any token
        except Exception as e:
            return self._error(e)
        async for _ in stream:
            pass
        return self._finish(req["request_id"], version, stream.result, domain, record, t0)

    async def generate_stream(self, req: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """First item: {"error": ...} or {"started": True}; then {"text": delta}...; last {"done": result}."""
        t0 = time.perf_counter()
        version, draft = self._pick(req)
        try:
            ids, params, domain, record = self._prepare(req)
            stream = self.engine.stream(ids, params, draft=draft)
        except Exception as e:
            yield self._error(e)
            return
        yield {"started": True, "prompt_tokens": len(ids)}
        text = IncrementalText(self.tokenizer, params.stop)
        async for toks in stream:
            yield {"text": text.push(toks)}
        result = stream.result
        yield {"text": text.finish(result.text or "")}
        yield {"done": self._finish(req["request_id"], version, result, domain, record, t0)}

    def stats(self) -> dict[str, Any]:
        self._sync_record_metrics()
        out: dict[str, Any] = {"replica": self.replica_id, "draft_version": self.draft_version,
                               "drafts": self.router.state(), "recording": self.producer is not None}
        if self.producer is not None:
            ps = self.producer.stats()
            out.update(records_written=ps.written, records_dropped=ps.dropped_total,
                       dropped_by_reason=dict(ps.dropped), queued=ps.queued, redis_up=ps.redis_up)
        else:
            out.update(records_written=0, records_dropped=0, dropped_by_reason={})
        return out

    def check_health(self) -> None:
        if self.engine is None:
            raise RuntimeError("engine not loaded")

    def __del__(self) -> None:
        router = getattr(self, "router", None)
        if router is not None:
            router.stop_following()
        producer = getattr(self, "producer", None)
        if producer is not None:
            producer.close(timeout=2.0)


# ---------------------------------------------------------------- ingress

api = FastAPI(title="osd: online speculative decoding", docs_url=None, redoc_url=None)


def _request_id(request: Request) -> str | None:
    rid = request.headers.get("x-request-id", "").strip()
    return rid[:128] if rid and rid.isprintable() else None


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


@serve.ingress(api)
class OpenAIIngress:
    def __init__(self, replica: Any, cfg_dict: dict[str, Any], api_key: str | None = None):
        self.replica = replica
        self.cfg = OSDConfig.model_validate(cfg_dict)
        self.api_key = api_key or None
        self.model_id = self.cfg.model.target
        self.replica_stats: dict[str, dict[str, Any]] = {}

    # -- helpers ---------------------------------------------------------------

    def _auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        if header != f"Bearer {self.api_key}":
            raise APIError(401, "missing or wrong API key (send Authorization: Bearer <key>)",
                           type_="authentication_error", code="invalid_api_key")

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_id, MODEL_ALIAS):
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.model_id!r}",
                           param="model", code="model_not_found")

    def _engine_request(self, req: Any, request_id: str | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "request_id": new_id("req"),
            # The X-Request-Id (a client's, or the one Serve's proxy assigns) fixes the canary arm.
            "route_key": request_id,
            "sampling": {"temperature": req.temperature, "top_k": req.top_k, "top_p": req.top_p, "seed": req.seed},
            "stop": list(req.stop_list()),
            "record": req.osd_record,
            "speculate": req.osd_speculate,
        }
        if isinstance(req, ChatCompletionRequest):
            out.update(kind="chat", messages=[m.model_dump() for m in req.messages], max_tokens=req.token_budget())
        else:
            out.update(kind="completion", prompt=req.prompt, max_tokens=req.max_tokens)
        return out

    async def _handle(self, request: Request, kind: type) -> Any:
        try:
            self._auth(request)
            req = parse_request(kind, await request.body(), self.cfg.serve.max_new_tokens)
            self._check_model(req.model)
            ereq = self._engine_request(req, _request_id(request))
            if req.stream:
                if kind is not ChatCompletionRequest:
                    raise APIError(400, "stream is supported on /v1/chat/completions", param="stream")
                return await self._stream_chat(ereq, req)
            result = await self.replica.generate.remote(ereq)
            if "error" in result:
                err = result["error"]
                raise APIError(err["status"], err["message"], code=err.get("code"))
            body = (chat_body if kind is ChatCompletionRequest else completion_body)(
                ereq["request_id"], self.model_id, result)
            return JSONResponse(body)
        except APIError as e:
            return _error_response(e)

    async def _stream_chat(self, ereq: dict[str, Any], req: ChatCompletionRequest) -> Any:
        gen = self.replica.options(stream=True).generate_stream.remote(ereq)
        first = await gen.__anext__()
        if "error" in first:
            err = first["error"]
            raise APIError(err["status"], err["message"], code=err.get("code"))
        return StreamingResponse(self._sse(gen, ereq, req), media_type="text/event-stream")

    async def _sse(self, gen: Any, ereq: dict[str, Any], req: ChatCompletionRequest) -> AsyncIterator[str]:
        rid, created = ereq["request_id"], int(time.time())
        yield chat_chunk(rid, self.model_id, created, {"role": "assistant", "content": ""})
        async for item in gen:
            if "text" in item:
                if item["text"]:
                    yield chat_chunk(rid, self.model_id, created, {"content": item["text"]})
            elif "done" in item:
                result = item["done"]
                yield chat_chunk(rid, self.model_id, created, {}, result["finish_reason"],
                                 extra={"usage": result["usage"], "osd": osd_extension(result)})
        yield SSE_DONE

    # -- routes ------------------------------------------------------------------

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Any:
        return await self._handle(request, CompletionRequest)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Any:
        return await self._handle(request, ChatCompletionRequest)

    @api.get("/v1/models")
    async def models(self, request: Request) -> Any:
        try:
            self._auth(request)
        except APIError as e:
            return _error_response(e)
        return {"object": "list", "data": [{"id": self.model_id, "object": "model", "created": 0, "owned_by": "osd"}]}

    @api.get("/healthz")
    async def healthz(self) -> Any:
        try:
            stats = await asyncio.wait_for(self.replica.stats.remote(), timeout=10)
        except Exception as e:
            return JSONResponse({"status": "unhealthy", "error": str(e)}, status_code=503)
        return {"status": "ok", "draft_version": stats["draft_version"]}

    @api.get("/osd/stats")
    async def osd_stats(self) -> Any:
        """Record counters summed over the replicas seen (a few calls reach each replica)."""
        calls = [self.replica.stats.remote() for _ in range(3 * self.cfg.serve.num_replicas)]
        for s in await asyncio.gather(*calls):
            self.replica_stats[s["replica"]] = s
        reps = list(self.replica_stats.values())
        return {
            "records_written": sum(r["records_written"] for r in reps),
            "records_dropped": sum(r["records_dropped"] for r in reps),
            "replicas": reps,
        }


def build_app(cfg: OSDConfig, api_key: str | None = None) -> Any:
    """The Serve application for this config: ingress bound to N target replicas."""
    cfg_dict = cfg.model_dump(mode="json")
    replica = serve.deployment(TargetReplica, name="TargetReplica").options(
        num_replicas=cfg.serve.num_replicas,
        ray_actor_options={"num_cpus": cfg.serve.num_cpus_per_replica},
        max_ongoing_requests=max(cfg.serve.max_concurrency * 4, 8),
        health_check_period_s=10,
    )
    ingress = serve.deployment(OpenAIIngress, name="OpenAIIngress").options(
        num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
    return ingress.bind(replica.bind(cfg_dict), cfg_dict, api_key if api_key is not None else os.environ.get("OSD_API_KEY"))

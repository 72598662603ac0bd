"""guidellm (vLLM's load benchmark), unmodified, against the real server: a short streaming chat run.

guidellm is not a dependency of this project: it pins older click and multidict than Ray's, so
it lives in a virtualenv of its own (docs/api.md). The test runs where the
`guidellm` command is found, on PATH or named by GUIDELLM_BIN, and is skipped elsewhere.
"""

import json
import os
import shutil
import subprocess

import pytest

from apps import running_app

pytestmark = [pytest.mark.ray, pytest.mark.redis]

KEY = "guidellm-key"
REQUESTS = 8
GUIDELLM = os.environ.get("GUIDELLM_BIN") or shutil.which("guidellm")


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    if not GUIDELLM:
        pytest.skip("guidellm is not installed (set GUIDELLM_BIN, see docs/api.md)")
    serve = {"draft": "truncate:1", "max_new_tokens": 64, "k": 3, "k_policy": "fixed", "record": False}
    with running_app(tmp_path_factory.mktemp("guidellm"), key=KEY, name="osd-guidellm", serve=serve,
                     stream_name="guidellm:records") as app:
        yield app


def guidellm(app, tmp_path, request_format: str, profile: str) -> dict:
    """One bounded guidellm run; its JSON report's benchmark."""
    from infra.target import tiny_tokenizer

    tokenizer = tmp_path / "tokenizer"  # guidellm sizes synthetic prompts with the target's tokenizer
    tiny_tokenizer().save_pretrained(tokenizer)
    out = tmp_path / f"report-{request_format.strip('/').replace('/', '-')}.json"
    cmd = [GUIDELLM, "run",
           "--backend", f"kind=openai_http,target={app['url']},model=tiny-random,api_key={KEY},max_tokens=16,"
                        f"request_format={request_format}",
           "--profile", profile, "--constraint", f"kind=max_requests,count={REQUESTS}",
           # output_tokens makes guidellm send ignore_eos, as its default benchmark does (honoured).
           "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
           "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
           "--output", f"kind=json,path={out}", "--disable-console"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return json.loads(out.read_text())["benchmarks"][0]


@pytest.mark.parametrize("request_format,profile", [
    ("/v1/chat/completions", "kind=synchronous"),
    ("/v1/completions", "kind=concurrent,streams=2"),
])
def test_guidellm_streaming_run_has_no_failures_and_real_latencies(app, tmp_path, request_format, profile):
    bench = guidellm(app, tmp_path, request_format, profile)
    requests = bench["requests"]
    assert len(requests["errored"]) == 0, requests["errored"][0]["error"] if requests["errored"] else ""
    assert len(requests["successful"]) == REQUESTS
    m = bench["metrics"]
    assert m["time_to_first_token_ms"]["successful"]["median"] > 0
    assert m["inter_token_latency_ms"]["successful"]["median"] > 0
    # Streamed: tokens arrived over many chunks, not in one body.
    assert m["request_streaming_iterations_count"]["successful"]["median"] > 1

"""The ops page on a running app (Ray Serve, tiny-random target, two registry drafts at a 50%
canary) with an API key: the page and its API refuse without the key, work with it, and in a
real headless Chromium the login form leads to a page with both version rows and its charts,
no console errors, and an auto-refresh that keeps working; a screenshot goes to reports/ops/."""

import json
import shutil
import time
from pathlib import Path

import pytest
import requests

from apps import running_app

pytestmark = [pytest.mark.ray, pytest.mark.redis]

KEY = "ops-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SCREENSHOT = Path(__file__).resolve().parent.parent / "reports" / "ops" / "ops.png"


@pytest.fixture(scope="module")
def app(tiny, tmp_path_factory):
    from infra.config import load_config
    from infra.drafts.layer import DraftSpec, build_draft, save_draft, target_ref
    from infra.registry import Registry

    state = tmp_path_factory.mktemp("ops-state")
    reg = Registry.from_config(load_config(environ={}, overrides={"state_dir": str(state)}))
    for i, layers in enumerate((1, 2), 1):
        spec = DraftSpec(num_layers=layers)
        save_draft(build_draft(tiny.model, spec), spec, state / f"d{i}", target_ref=target_ref(tiny))
        reg.publish(state / f"d{i}", f"v{i}", lineage={"parent": "v1" if i == 2 else None})
    reg.promote("v1")
    reg.set_canary("v2", 0.5)
    reg.audit({"action": "start", "version": "v2", "weight": 0.5, "reason": "set by the test"})
    serve = {"draft": "registry", "alias_poll_s": 0.2, "max_new_tokens": 16, "k": 3, "record": True}
    with running_app(tmp_path_factory.mktemp("ops-redis"), key=KEY, name="osd-ops-test", serve=serve,
                     stream_name="ops:records", extra={"state_dir": str(state)}) as a:
        _traffic(a["url"], 24)
        yield a


def _traffic(url, n):
    """n chat requests; distinct request ids split them between stable and canary."""
    for i in range(n):
        r = requests.post(url + "/v1/chat/completions", timeout=120,
                          headers={**AUTH, "Content-Type": "application/json", "X-Request-Id": f"ops-{i}"},
                          data=json.dumps({"model": "osd", "max_tokens": 12, "temperature": 0,
                                           "messages": [{"role": "user", "content": f"count to {i}"}]}))
        assert r.status_code == 200, r.text


def _summary(url, want=("v1", "v2"), timeout=60):
    """The summary once both versions have rows with records (records are written asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        s = requests.get(url + "/ops/api/summary", headers=AUTH, timeout=60).json()
        rows = {r["version"]: r for r in s["versions"]}
        if all(rows.get(v, {}).get("records") for v in want) or time.monotonic() > deadline:
            return s
        time.sleep(1)


def test_without_the_key_page_and_api_refuse(app):
    url = app["url"]
    for path in ("/ops/api/summary", "/ops/fragment"):
        assert requests.get(url + path, timeout=30).status_code == 401
        assert requests.get(url + path, headers={"Cookie": "osd_ops_session=1.forged"}, timeout=30).status_code == 401
    page = requests.get(url + "/ops", allow_redirects=False, timeout=30)
    assert page.status_code == 303 and page.headers["location"] == "/ops/login"
    bad = requests.post(url + "/ops/login", data={"key": "wrong"}, allow_redirects=False, timeout=30)
    assert bad.status_code == 401 and "set-cookie" not in bad.headers
    assert requests.get(url + "/v1/models", timeout=30).status_code == 401  # the rest stays locked


def test_with_the_key_api_reports_both_versions(app):
    s = _summary(app["url"])
    rows = {r["version"]: r for r in s["versions"]}
    assert [r["version"] for r in s["versions"]][:2] == ["v1", "v2"]
    assert rows["v1"]["role"] == "stable" and rows["v2"]["role"] == "canary"
    assert rows["v1"]["requests"] + rows["v2"]["requests"] == 24
    assert all(0 <= rows[v]["acceptance"] <= 1 and rows[v]["latency_p50_s"] > 0 for v in ("v1", "v2"))
    assert s["header"]["canary_weight"] == 0.5 and s["loop"]["records_written"] >= 2


def test_a_cookie_session_from_the_form_opens_the_api_but_not_the_openai_routes(app):
    url = app["url"]
    login = requests.post(url + "/ops/login", data={"key": KEY}, allow_redirects=False, timeout=30)
    assert login.status_code == 303 and KEY not in login.headers["location"]
    cookie = login.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and KEY not in cookie
    jar = login.cookies
    assert requests.get(url + "/ops/api/summary", cookies=jar, timeout=60).status_code == 200
    assert requests.get(url + "/v1/models", cookies=jar, timeout=30).status_code == 401


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "Chromium is missing: `make setup` installs Debian's chromium package"
    return path


def test_real_browser_signs_in_and_sees_rows_and_charts(app):
    sync_api = pytest.importorskip("playwright.sync_api")
    _summary(app["url"])  # records of both versions are in
    errors: list[str] = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(app["url"] + "/ops")
            assert page.url.endswith("/ops/login")
            page.fill("input[name=key]", KEY)
            page.click("button[type=submit]")
            page.wait_for_selector("#ops-versions")
            assert page.url.endswith("/ops") and KEY not in page.url
            versions = page.eval_on_selector_all("tr.version-row", "rs => rs.map(r => r.dataset.version)")
            assert versions[:2] == ["v1", "v2"]
            assert page.locator("svg.chart").count() == 4  # acceptance, positions, canary weight, batch size
            assert page.locator("svg.chart .point").count() >= 2  # acceptance of each version
            assert page.locator("svg.chart polyline.series").count() >= 1  # the canary weight
            assert page.locator("svg.chart rect.bar").count() >= 2  # per-position bars
            cookies = {c["name"]: c for c in page.context.cookies()}
            assert cookies["osd_ops_session"]["httpOnly"]
            before = page.text_content("#ops-header")
            page.wait_for_timeout(11_000)  # one auto-refresh (10 s) through the cookie
            assert page.text_content("#ops-refresh") == "" and page.locator("tr.version-row").count() >= 2
            assert page.text_content("#ops-header") != before  # "data as of" moved
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), full_page=True)
        finally:
            browser.close()
    assert errors == []
    assert SCREENSHOT.stat().st_size > 10_000

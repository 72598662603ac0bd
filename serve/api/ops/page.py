"""The ops page's HTML, rendered from the summary document (serve/api/ops/source.py).

Server-side: tables and SVG charts (serve/api/ops/svg.py), no external asset. The live page
refreshes its main section every REFRESH_S with a same-origin fetch of `/ops/fragment`; the
demo's static snapshot is the same render without the script.
"""

from __future__ import annotations

import html
import math
import time
from typing import Any

from serve.api.ops import svg as ops_svg

REFRESH_S = 10
# The pages' <head> names an empty icon: a browser's /favicon.ico request would hit the key check.

_CSS = """
body{font-family:system-ui,sans-serif;margin:16px;color:#111827;background:#f9fafb}
h1{font-size:20px;margin:0 0 8px} h2{font-size:15px;margin:18px 0 6px}
table{border-collapse:collapse;background:#fff;font-size:13px} td,th{border:1px solid #e5e7eb;padding:3px 7px;text-align:right}
th{background:#f3f4f6} td.l,th.l{text-align:left}
.pass{color:#15803d;font-weight:600} .fail{color:#b91c1c;font-weight:600} .pending{color:#a16207}
.role-stable{background:#eff6ff} .role-canary{background:#fef3c7}
.cards{display:flex;flex-wrap:wrap;gap:12px} .card{background:#fff;border:1px solid #e5e7eb;padding:8px}
.chart{width:560px;max-width:100%} .muted{color:#6b7280;font-size:12px}
"""

_SCRIPT = """
<script>
// Refresh the main section in place; a failed fetch keeps the last good view and says so.
setInterval(async () => {
  const el = document.getElementById('ops-main'), st = document.getElementById('ops-refresh');
  try {
    const r = await fetch('/ops/fragment', {credentials: 'same-origin', cache: 'no-store'});
    if (r.status === 401) { window.location.assign('/ops/login'); return; }
    if (!r.ok) throw new Error('HTTP ' + r.status);
    el.innerHTML = await r.text();
    st.textContent = '';
  } catch (e) { st.textContent = 'refresh failed: ' + e.message + ' (showing the last data)'; }
}, %d);
</script>
"""


def _e(x: Any) -> str:
    return html.escape("" if x is None else str(x), quote=True)


def _t(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts)) if ts else "-"


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def page(summary: dict[str, Any], *, live: bool = True) -> str:
    title = "osd ops" + ("" if live else " (snapshot)")
    script = _SCRIPT % (REFRESH_S * 1000) if live else ""
    note = f"refreshes every {REFRESH_S} s" if live else "static snapshot; not refreshed"
    return (f"<!doctype html><html lang=en><head><meta charset=utf-8><link rel=icon href='data:,'><title>{title}</title>"
            f"<meta name=viewport content='width=device-width'><style>{_CSS}</style></head><body>"
            f"<h1>{title}</h1><div class=muted>{note} <span id=ops-refresh></span></div>"
            f"<div id=ops-main>{main(summary)}</div>{script}</body></html>")


def main(s: dict[str, Any]) -> str:
    problems = "".join(f"<p class=fail>{_e(p)}</p>" for p in s.get("problems", []))
    return "".join([problems, _header(s), _comparison(s.get("comparison")), _versions(s["versions"]), _charts(s),
                    _adapt(s.get("adapt")), _loop(s["loop"]), _registry(s["registry"])])


def _adapt(a: dict[str, Any] | None) -> str:
    """Time to adapt (serve/api/ops/adapt.py): the last shift of the traffic's domain mix and the
    loop's answer to it."""
    if a is None:
        return ("<div class=card id=ops-adapt>Time to adapt: <span class=muted>no shift in the traffic's "
                "domain mix within the window</span></div>")
    sh = a["shift"]
    mix = lambda m: ", ".join(f"{_e(k)} {v:.0%}" for k, v in m.items())  # noqa: E731
    if a["promoted"] is None:
        answer = f"no promotion yet ({a['waiting_min']:.1f} min waited)"
    else:
        gain = "" if a["gain"] is None else f", acceptance {a['gain']:+.3f} over {_e(a['replaced'])}"
        answer = f"{_e(a['promoted'])} promoted {a['minutes']:.1f} min after it{gain}"
    return (f"<div class=card id=ops-adapt>Time to adapt: the domain mix shifted at {_t(sh['time'])} "
            f"({mix(sh['before'])} &rarr; {mix(sh['after'])}); {answer}</div>")


def _header(s: dict[str, Any]) -> str:
    h = s["header"]
    step = f"step {h['canary_step']} of {len(h['canary_steps'])}" if h["canary_step"] else ""
    canary = f"{_e(h['canary'])} at {h['canary_weight']:.0%} {step}" if h["canary"] else "none"
    d = h["last_decision"]
    last = (f"<b>{_e(d['action'])}</b> {_e(d['version'])} at {_t(d['time'])}{' (by hand)' if d['manual'] else ''}: "
            f"{_e(d['reason'])}" if d else "none yet")
    return (f"<div class='card' id=ops-header><div>Stable: <b id=ops-stable>{_e(h['stable'] or 'none')}</b>"
            f" &middot; Canary: <b id=ops-canary>{canary}</b></div><div>Last decision: {last}</div>"
            f"<div class=muted>Data as of {_t(s['as_of'])}; window {s['window_s'] / 60:.0f} min</div></div>")


def _comparison(c: dict[str, Any] | None) -> str:
    if not c:
        return "<h2>Canary vs stable</h2><p class=muted>No canary is running.</p>"
    n = c["requests"]
    head = (f"<h2>Canary vs stable</h2><p class=muted>{_e(c['canary'])} minus {_e(c['stable'])} since "
            f"{_t(c['since'])} (the controller's window): {n['canary']} canary and {n['stable']} stable requests "
            f"with records; decisions need {c['min_requests']} each. Always-valid intervals, alpha {c['alpha']}.</p>")
    if not c["checks"]:
        return head
    rows = "".join(f"<tr><td class=l>{_e(k['metric'])}</td><td class=l>{_e(k['check'])}</td><td>{k['diff']:+.4f}</td>"
                   f"<td>[{k['lower']:+.4f}, {k['upper']:+.4f}]</td><td>{k['threshold']:+.4f}</td>"
                   f"<td class={k['verdict']}>{k['verdict']}</td></tr>" for k in c["checks"])
    return (head + "<table id=ops-deltas><tr><th class=l>metric</th><th class=l>check</th><th>canary - stable</th>"
            "<th>interval</th><th>threshold</th><th>verdict</th></tr>" + rows + "</table>")


def _versions(rows: list[dict[str, Any]]) -> str:
    head = ("<h2>Versions</h2><table id=ops-versions><tr><th class=l>version</th><th class=l>role</th>"
            "<th>requests</th><th>records</th><th>draft tokens</th><th>acceptance</th><th>95% CI</th>"
            "<th>mean accepted len</th><th>output tok/s</th><th>latency p50 s</th><th>p95 s</th><th>error rate</th></tr>")
    body = []
    for r in rows:
        ci = f"[{r['acceptance_ci'][0]:.3f}, {r['acceptance_ci'][1]:.3f}]" if r["acceptance_ci"] else "-"
        body.append(f"<tr class='version-row role-{_e(r['role'])}' data-version='{_e(r['version'])}'>"
                    f"<td class=l>{_e(r['version'])}</td><td class=l>{_e(r['role'])}</td><td>{r['requests']}</td>"
                    f"<td>{r['records']}</td><td>{r['draft_tokens']}</td><td>{_f(r['acceptance'])}</td><td>{ci}</td>"
                    f"<td>{_f(r['mean_accepted_len'], '.2f')}</td><td>{_f(r['output_tokens_per_s'], '.1f')}</td>"
                    f"<td>{_f(r['latency_p50_s'])}</td><td>{_f(r['latency_p95_s'])}</td>"
                    f"<td>{_f(r['error_rate'], '.2%')}</td></tr>")
    if not rows:
        body.append("<tr><td class=l colspan=12>no traffic in the window</td></tr>")
    return head + "".join(body) + "</table>"


def _charts(s: dict[str, Any]) -> str:
    ch, t1 = s["charts"], s["as_of"]
    t0 = ch["from"]
    acc = ops_svg.line_chart("Acceptance over time, per version", ch["acceptance"], t0, t1, markers=ch["markers"])
    pos = ops_svg.bar_chart("Acceptance per draft position (accepted / drafting steps)", ch["per_position"])
    wgt = ops_svg.step_chart("Canary weight", ch["canary_weight"], t0, t1)
    batch = ch.get("batch_size") or {}
    top = max([v for pts in batch.values() for _, v in pts] + [1.0])
    bat = ops_svg.line_chart("Requests per target forward", batch, t0, t1, lo=0.0, hi=float(math.ceil(top)))
    return ("<h2>Charts</h2><div class=cards>" + "".join(
        f"<div class=card><div>{title}</div>{svg}</div>" for title, svg in
        (("Acceptance over time (markers: rollout decisions)", acc), ("Acceptance per draft position", pos),
         ("Canary weight", wgt), ("Batch size over time (requests per target forward)", bat))) + "</div>")


def _loop(lp: dict[str, Any]) -> str:
    drops = ", ".join(f"{_e(k)} {v}" for k, v in sorted(lp["records_dropped"].items())) or "none"
    restarts = ", ".join(f"{_e(k)} {v}" for k, v in lp.get("restarts", {}).items()) or "none"
    rec = lp.get("last_recovery")
    if rec:
        restarts += f" &middot; last back: {_e(rec['component'])} at {_t(rec['time'])}"
    st = lp["stream"]
    groups = "".join(f"<tr><td class=l>{_e(g['group'])}</td><td>{_e(g['lag'])}</td><td>{_e(g['pending'])}</td>"
                     f"<td>{_e(g['consumers'])}</td></tr>" for g in st["groups"])
    trainers = "".join(f"<tr><td class=l>{_e(t['component'])}</td><td>{t['step']}</td><td>{_f(t['loss'], '.4f')}</td>"
                       f"<td>{t['records']}</td><td>{t['exports']}</td><td class=l>{_e(t['last_checkpoint'])}</td>"
                       f"<td class=l>{_t(t['time'])}</td></tr>" for t in lp["trainers"])
    cand = lp["last_candidate"]
    cand_s = f"{_e(cand['version'])}: estimated alpha {_f(cand['alpha_est'])}" if cand else "none"
    sx = lp.get("suffix")
    suffix_s = (f"<br>Suffix index {sx['tokens']} tokens ({sx['bytes'] / 2**20:.1f} MiB) &middot; a chain on "
                f"{100 * sx['proposal_rate']:.0f}% of lookups" if sx else "")
    sources = "".join(f"<tr><td class=l>{_e(r['draft_version'])}</td><td class=l>{_e(r['source'])}</td>"
                      f"<td>{r['steps']}</td><td>{_f(r['acceptance'])}</td><td>{_f(r['tokens_per_step'], '.2f')}</td></tr>"
                      for r in lp.get("by_source") or ())
    sources_s = (f"<div class=card><table id=ops-sources><tr><th class=l>version</th><th class=l>proposed by</th>"
                 f"<th>drafting steps</th><th>acceptance</th><th>tokens/step</th></tr>{sources}</table></div>"
                 if sources else "")
    return (f"<h2>Loop health</h2><div class=cards><div class=card id=ops-records>Records written "
            f"{lp['records_written']} &middot; replayed from a killed replica's spool {lp.get('records_replayed', 0)}"
            f" &middot; dropped: {drops} <span class=muted>({lp['replicas']} replicas seen)"
            f"</span><br>Stream length {_e(st['length'])} &middot; dead-lettered {_e(st['dead_lettered'])}"
            f"<br>Last candidate {cand_s}{suffix_s}<br><span id=ops-restarts>Restarts: {restarts}</span></div>"
            f"<div class=card><table id=ops-groups><tr><th class=l>group</th><th>lag</th><th>pending</th>"
            f"<th>consumers</th></tr>{groups}</table></div>"
            f"<div class=card><table id=ops-trainers><tr><th class=l>trainer</th><th>step</th><th>loss</th>"
            f"<th>records</th><th>exports</th><th class=l>last checkpoint</th><th class=l>as of</th></tr>{trainers}"
            f"</table></div>{sources_s}</div>")


def _registry(reg: dict[str, Any]) -> str:
    versions = "".join(f"<tr><td class=l>{_e(v['version'])}</td><td class=l>{_e(v['parent'])}</td>"
                       f"<td>{_e(v['records_consumed'])}</td><td>{_f(v['alpha_est'])}</td>"
                       f"<td class=l>{_t(v['created_at'])}</td></tr>" for v in reg["versions"])
    hist = "".join(f"<tr><td class=l>{_t(h['time'])}</td><td class=l>{_e(h['action'])}</td>"
                   f"<td class=l>{_e(h['version'])}</td><td>{_e(h['weight'])}</td>"
                   f"<td class=l>{_e(h['reason'])}{' (by hand)' if h['manual'] else ''}</td></tr>"
                   for h in reg["alias_history"])
    return ("<h2>Registry</h2><div class=cards><div class=card><table id=ops-registry><tr><th class=l>version</th>"
            "<th class=l>parent</th><th>records consumed</th><th>estimated alpha</th><th class=l>created</th></tr>"
            f"{versions}</table></div><div class=card><table id=ops-audit><tr><th class=l>time</th>"
            "<th class=l>action</th><th class=l>version</th><th>weight</th><th class=l>reason</th></tr>"
            f"{hist}</table></div></div>")


def login_page(error: str = "") -> str:
    err = f"<p class=fail>{_e(error)}</p>" if error else ""
    return (f"<!doctype html><html lang=en><head><meta charset=utf-8><link rel=icon href='data:,'><title>osd ops: sign in</title>"
            f"<style>{_CSS}</style></head><body><h1>osd ops</h1>{err}"
            "<form method=post action=/ops/login><label>API key <input type=password name=key "
            "autocomplete=current-password autofocus></label> <button type=submit>Sign in</button></form>"
            "<p class=muted>The key is sent once, in this form's body; the page then uses an HttpOnly "
            "session cookie.</p></body></html>")


def fetch_summary(url: str, api_key: str | None = None, timeout: float = 60) -> dict[str, Any] | None:
    """The live summary from a running app (None if it cannot be had: a snapshot is a nicety)."""
    import json
    import urllib.error
    import urllib.request

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{url}/ops/api/summary", headers=headers),
                                    timeout=timeout) as resp:
            return json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None

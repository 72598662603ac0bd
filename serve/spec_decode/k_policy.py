"""How many tokens to draft in a step: the rule that never speculates at a loss.

A step that drafts k tokens and verifies them emits, under the usual geometric model with
per-position acceptance alpha (Leviathan et al. 2023), E(k) = 1 + alpha + ... + alpha^k
tokens, and costs V(k+1) + k·c + s: one target forward of k+1 tokens, k draft tokens, and
the step's fixed work s (verify, commit). k = 0 is plain decoding, E = 1 at V(1) + s. The
rule takes the k in 0..k_max with the most expected tokens per second, so a draft whose
acceptance cannot pay for its verify drafts nothing, and a cheap, accurate one drafts deep.

Costs are measured, not assumed: V by token count at engine start (`profile_forward`) and
then from every scored step, c and s from every step (exponentially weighted, so they
follow the context growing and the machine's load). Acceptance is estimated per request,
starting from what the same draft achieved on earlier requests.

A request at k = 0 learns nothing about its draft, so it drafts one token after
`probe_every` idle steps, and waits twice as long after each probe that is rejected (up to
MAX_IDLE steps; the back-off carries over to the draft's next requests): a useless draft
then costs a probe's verify row and the draft's catch-up over the skipped tokens once in
16, 32, 64, ... steps.

The engine asks one policy (`length_policy`: cost, schedule or fixed, the LengthPolicy
protocol) once per step for every request of the step; each request keeps its own state in
one object the policy made (a RequestLength). A request's minimum draft (a canary's, so both
arms report served acceptance) is that request's property, applied by every policy alike.

In a batch the cost rule first asks its gate (draft_gate.py) whether the step may draft at
all: what that costs besides verify rows is measured there, steps that may against steps
that may not.

Pure: no torch, milliseconds to test with a fake profile.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from serve.spec_decode.draft_gate import DraftGate

PROBE_EVERY = 16
MAX_IDLE = 256
EWMA = 0.2  # weight of a new cost observation
DECAY = 0.9  # per step, of a request's acceptance counts (a draft's fit drifts within a reply)
SHARED_WEIGHT = 4.0  # positions' worth of the draft's long-run acceptance in a request's estimate


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a step emits in expectation: the accepted prefix of k drafts plus the target's own."""
    return sum(alpha ** i for i in range(k + 1))


def best_k(verify_s: Sequence[float], draft_s: float, step_s: float, alpha: float, k_max: int) -> int:
    """The draft length in 0..k_max (and within the profile) with the most expected tokens per
    second. verify_s[t - 1]: seconds of a target forward of t tokens; draft_s: seconds per
    drafted token; step_s: fixed seconds per step. Ties go to the shorter draft. A forward of
    fewer tokens never costs more than one of more: the profile is read through its lower
    envelope from the right, so one noisy measurement does not rule a length out."""
    return plan_batch(verify_s, 1, [alpha], [min(k_max, len(verify_s) - 1)], [draft_s], step_s)[0]


def rows_cost(verify_s: Sequence[float], rows: int) -> float:
    """Seconds of a target forward of `rows` rows: the profile's lower envelope from the right
    (as best_k reads it), extended past its end along its last slope."""
    n = len(verify_s)
    if rows <= n:
        return min(verify_s[rows - 1:])
    slope = max(verify_s[-1] - verify_s[-2], 0.0) if n > 1 else verify_s[-1]
    return verify_s[-1] + slope * (rows - n)


def chain_expected(probs: Sequence[float]) -> float:
    """Expected accepted tokens of a chain whose tokens have these conditional probabilities."""
    expected, path = 0.0, 1.0
    for p in probs:
        path *= p
        expected += path
    return expected


def chain_cut(verify_s: Sequence[float], step_s: float, base_rows: int, others: float,
              probs: Sequence[float]) -> int:
    """How many tokens of a chosen chain (a suffix draft's: no draft cost, each token's
    conditional probability known) to verify: the n with the most expected tokens per second
    for the whole step, (others + 1 + sum of the first n path probabilities) / (C(base_rows +
    n) + step_s). base_rows: the step's rows without this chain; others: the tokens the rest
    of the batch is expected to emit. Ties go to the shorter chain."""
    best_n, best = 0, (others + 1.0) / (rows_cost(verify_s, base_rows) + step_s)
    expected, path = 1.0, 1.0
    for n, p in enumerate(probs, 1):
        path *= p
        expected += path
        value = (others + expected) / (rows_cost(verify_s, base_rows + n) + step_s)
        if value > best:
            best_n, best = n, value
    return best_n


def plan_batch(verify_s: Sequence[float], base_rows: int, alphas: Sequence[float], limits: Sequence[int],
               draft_s: Sequence[float], step_s: float, prompt_rows: int = 0) -> list[int]:
    """Draft lengths for the sequences of one batched step: the allocation with the most
    expected tokens per second over the whole batch,

        (P + sum_i E(alpha_i, k_i)) / (C(base_rows + sum_i k_i) + sum_i k_i * draft_s[i] + step_s),

    where C is the forward's cost by its row count (verify_s[r - 1], read as rows_cost does),
    base_rows the rows the step runs anyway (one per decoding sequence, prompt chunks) and P
    the step's prompt rows, each worth the token a decode row would have made of the same
    compute. Counted as nothing, a step's prompt rows made any draft row look cheap, since
    the step's rate was low anyway (tests/test_batching.py has the case).
    Draft position j of sequence i adds alpha_i^j expected tokens, so the best allocation with
    a given number of draft tokens takes the positions of largest alpha_i^j; the rule tries
    every such prefix, including none (plain decoding at the same load), and keeps the best.
    As the batch grows, a draft row displaces more and gains less: drafting shrinks to none
    exactly when it would lower the batch's token rate. For one sequence this is best_k."""
    ks = [0] * len(alphas)
    gains = sorted(((alphas[i] ** j, i) for i in range(len(alphas)) for j in range(1, limits[i] + 1)
                    if alphas[i] > 0), key=lambda g: -g[0])
    tokens = float(len(alphas) + prompt_rows)
    extra = 0.0
    best_rate = tokens / (rows_cost(verify_s, max(base_rows, 1)) + step_s)
    best_n = 0
    for n, (gain, i) in enumerate(gains, 1):
        tokens += gain
        extra += draft_s[i]
        rate = tokens / (rows_cost(verify_s, base_rows + n) + extra + step_s)
        if rate > best_rate:
            best_rate, best_n = rate, n
    for _, i in gains[:best_n]:
        ks[i] += 1
    return ks


class Acceptance:
    """Decayed counts of accepted / reached draft positions: alpha given the earlier drafts
    accepted (a step that accepts n of k reached n + 1 positions, or k when all were taken).
    Starts from `weight` pseudo-positions at `prior`, which decay with the data, so after a
    few dozen steps the estimate is the draft's own."""

    def __init__(self, prior: float = 0.5, weight: float = 2.0):
        self.accepted = prior * weight
        self.reached = weight

    @property
    def alpha(self) -> float:
        return self.accepted / self.reached if self.reached > 0 else 0.0

    def observe(self, drafted: int, accepted: int, decay: float = DECAY) -> None:
        """One step that drafted `drafted` and kept `accepted`."""
        if drafted <= 0:
            return
        self.accepted = self.accepted * decay + accepted
        self.reached = self.reached * decay + accepted + (accepted < drafted)

    def fade(self, decay: float = DECAY) -> None:
        """A step without drafts: old evidence loses weight, nothing new comes in."""
        self.accepted *= decay
        self.reached *= decay


@dataclass
class StepCosts:
    """Seconds per target forward by token count, per drafted token (per draft), and per step."""

    verify_s: list[float]
    step_s: float = 0.0
    draft_s: dict[object, float] = field(default_factory=dict)
    default_draft_fraction: float = 0.1  # of V(1), until a draft's own cost is seen
    frozen: bool = False  # ignore observations (a fixed, given profile)
    batch_scale: float = 1.0  # measured / profiled cost of batched forwards (observe_batch)

    def draft_cost(self, key: object) -> float:
        return self.draft_s.get(key, self.default_draft_fraction * self.verify_s[0])

    def observe_verify(self, tokens: int, seconds: float) -> None:
        if not self.frozen and 1 <= tokens <= len(self.verify_s):
            i = tokens - 1
            self.verify_s[i] += EWMA * (seconds - self.verify_s[i])

    def observe_draft(self, key: object, drafted: int, seconds: float) -> None:
        if drafted > 0 and not self.frozen:
            per = seconds / drafted
            old = self.draft_s.get(key)
            self.draft_s[key] = per if old is None else old + EWMA * (per - old)

    def observe_batch(self, rows: int, seconds: float) -> None:
        """A forward of several sequences: it also pays their attention over their contexts, which
        the profile by rows does not see. Its cost scales the whole profile (`batch_scale`)
        instead of one entry, so the cost of a draft row, a difference of two entries, is not
        read off one measured and one profiled figure."""
        if not self.frozen and 1 <= rows:
            ratio = seconds / rows_cost(self.verify_s, rows)
            self.batch_scale += EWMA * (ratio - self.batch_scale)

    def batch_profile(self) -> list[float]:
        return [v * self.batch_scale for v in self.verify_s]

    def observe_step(self, seconds: float) -> None:
        if not self.frozen:
            self.step_s += EWMA * (seconds - self.step_s)


class RequestLength(Protocol):
    """One request's share of the policy: what it learned of its draft."""
    min_draft: int  # drafts at least this many a step while it can (0: the rule decides)
    probing: bool  # this step's draft is a probe (the cost rule's), which teaches no draft cost

    @property
    def alpha(self) -> float:
        """The request's acceptance estimate (a neutral 0.5 where the policy keeps none)."""

    def observe(self, drafted: int, accepted: int) -> None:
        """What the step's verify accepted of its drafts."""

    def observe_costs(self, drafted: int, draft_s: float, step_s: float, teaches: bool) -> None:
        """The step's draft and fixed seconds (teaches: the draft's tokens count as its own)."""


class LengthPolicy(Protocol):
    """Per engine: the one rule that sizes drafts."""
    k_max: int
    # The cost profile's cut of a proposed chain (StepContext.cut), where the policy has one.
    cut: Callable[[list[float], int, int], int] | None
    gated: bool  # the step planned last drafts nothing but the plan (StepContext.gated)

    def start(self, draft_key: object, min_draft: int = 0) -> RequestLength:
        """A new request's state, drafting with the draft `draft_key` names."""

    def plan(self, requests: Sequence[RequestLength | None], limits: Sequence[int], base_rows: int,
             prompt_rows: int = 0) -> list[int]:
        """Every request's draft length for one step, each at most its limit (budget and
        context). None: a request without a draft, which decodes (0). base_rows: the
        step's rows besides drafts (a row a request, prompt chunks), of which prompt_rows
        are prompt chunks'."""

    def observe_forward(self, sequences: int, rows: int, seconds: float) -> None:
        """A target forward's measured cost."""

    def observe_step(self, emitted: int, prompt_rows: int, seconds: float) -> None:
        """The step planned last: the tokens it emitted, beside its prompt rows, in `seconds`."""


def with_min_draft(r: RequestLength, k: int, limit: int, k_max: int) -> int:
    return max(k, min(r.min_draft, limit, k_max)) if r.min_draft else k


@dataclass
class FixedRequest:
    k: int
    min_draft: int = 0
    probing: bool = False
    alpha: float = 0.5

    def observe(self, drafted: int, accepted: int) -> None:
        pass

    def observe_costs(self, drafted: int, draft_s: float, step_s: float, teaches: bool) -> None:
        pass


@dataclass
class ScheduleRequest(FixedRequest):
    k_max: int = 1

    def observe(self, drafted: int, accepted: int) -> None:
        """Hugging Face's assistant schedule: +2 after a step whose drafts were all accepted,
        -1 (not below 1) otherwise."""
        if drafted:
            self.k = min(self.k + 2, self.k_max) if accepted == drafted else max(self.k - 1, 1)


class FixedLength:
    """k every step (at most the limit)."""
    cut = None
    gated = False

    def __init__(self, k_max: int):
        self.k_max = k_max

    def start(self, draft_key: object, min_draft: int = 0) -> RequestLength:
        return FixedRequest(self.k_max, min_draft)

    def plan(self, requests: Sequence[RequestLength | None], limits: Sequence[int], base_rows: int,
             prompt_rows: int = 0) -> list[int]:
        return [with_min_draft(r, min(r.k, lim), lim, self.k_max) if r is not None else 0  # type: ignore[attr-defined]
                for r, lim in zip(requests, limits)]

    def observe_forward(self, sequences: int, rows: int, seconds: float) -> None:
        pass

    def observe_step(self, emitted: int, prompt_rows: int, seconds: float) -> None:
        pass


class ScheduleLength(FixedLength):
    """Each request's budget moves with its acceptance (ScheduleRequest), from k_max."""

    def start(self, draft_key: object, min_draft: int = 0) -> RequestLength:
        return ScheduleRequest(self.k_max, min_draft, k_max=self.k_max)


class KPolicy:
    """The cost rule (module doc), per engine: the costs, each draft's acceptance across
    requests, and the choice per step; for a batch, first the gate's (draft_gate.py)."""

    def __init__(self, costs: StepCosts, k_max: int, probe_every: int = PROBE_EVERY,
                 gate: DraftGate | None = None):
        self.costs = costs
        self.k_max = k_max
        self.probe_every = probe_every
        self.by_draft: dict[object, Acceptance] = {}
        self.idle_limit: dict[object, int] = {}  # per draft: the probe back-off, carried across requests
        self.gate = gate  # None: no gate, the rule alone sizes a batch's drafts
        self.decided: tuple[int, bool] | None = None  # the gate's call on the step planned last: (requests, drafting)

    @property
    def gated(self) -> bool:
        return self.decided is not None and not self.decided[1]

    def plan(self, requests: Sequence["RequestK | None"], limits: Sequence[int], base_rows: int,
             prompt_rows: int = 0) -> list[int]:
        """Draft lengths for one step: a request alone by its own rule (RequestK.choose); a
        batch that the gate holds back drafts only its requests' minimums; any other batch by
        plan_batch, then each request's probe rule (RequestK.settle) and minimum."""
        self.decided = None
        if len(requests) == 1 and base_rows == 1 and requests[0] is not None:
            return [with_min_draft(requests[0], requests[0].choose(limits[0]), limits[0], self.k_max)]
        if self.gate is not None:
            self.decided = (len(requests), self.gate.allow(len(requests)))
        if self.gated:
            return [with_min_draft(r, 0, lim, self.k_max) if r is not None else 0 for r, lim in zip(requests, limits)]
        c = self.costs
        alphas = [r.alpha if r is not None else 0.0 for r in requests]
        draft_s = [c.draft_cost(r.draft_key) if r is not None else 0.0 for r in requests]
        caps = [min(self.k_max, lim) if r is not None else 0 for r, lim in zip(requests, limits)]
        profile = c.verify_s if len(requests) == 1 else c.batch_profile()
        ks = plan_batch(profile, base_rows, alphas, caps, draft_s, c.step_s * len(requests), prompt_rows)
        return [with_min_draft(r, r.settle(k, lim), lim, self.k_max) if r is not None else 0
                for r, k, lim in zip(requests, ks, limits)]

    def start(self, draft_key: object, min_draft: int = 0) -> "RequestK":
        shared = self.by_draft.setdefault(draft_key, Acceptance())
        return RequestK(self, draft_key, Acceptance(weight=0.0), shared, idle_limit=self.idle_limit.get(draft_key, 0),
                        min_draft=min_draft)

    def observe_forward(self, sequences: int, rows: int, seconds: float) -> None:
        if sequences == 1:  # a request alone: the profile's own entry
            self.costs.observe_verify(rows, seconds)
        else:
            self.costs.observe_batch(rows, seconds)

    def observe_step(self, emitted: int, prompt_rows: int, seconds: float) -> None:
        """Once per step; a step the policy did not plan (none of its requests drafts) follows
        one it did, so the gate's call is used once."""
        if self.gate is not None and self.decided is not None:
            self.gate.observe(*self.decided, emitted, prompt_rows, seconds)
        self.decided = None

    def cut(self, probs: list[float], base_rows: int, others: int) -> int:
        """StepContext.cut: a proposed chain's length that pays, on this engine's profile."""
        profile = self.costs.batch_profile() if base_rows > 1 else self.costs.verify_s
        return chain_cut(profile, self.costs.step_s, base_rows, others, probs)


def length_policy(name: str, k_max: int, profile: Callable[[], list[float]], gate: bool = True) -> LengthPolicy:
    """The policy serve.k_policy names; `profile` times the target (the cost rule's V); `gate`:
    the cost rule's measured gate on batched drafting (serve.draft_gate)."""
    if name == "cost":
        return KPolicy(StepCosts(profile()), k_max, gate=DraftGate() if gate else None)
    if name == "schedule":
        return ScheduleLength(k_max)
    if name == "fixed":
        return FixedLength(k_max)
    raise ValueError(f"unknown k_policy {name!r}: cost, schedule or fixed")


@dataclass
class RequestK:
    policy: KPolicy
    draft_key: object
    own: Acceptance
    shared: Acceptance
    idle_steps: int = 0
    idle_limit: int = 0  # steps at k = 0 before the next probe (0: probe_every)
    probing: bool = False
    min_draft: int = 0

    @property
    def alpha(self) -> float:
        """The request's own recent acceptance, pulled towards its draft's long-run figure by
        SHARED_WEIGHT positions: a few early rejections do not decide a whole reply."""
        own, w = self.own, SHARED_WEIGHT
        return (own.accepted + w * self.shared.alpha) / (own.reached + w)

    def choose(self, limit: int) -> int:
        """Draft length for this step, at most `limit` (the token budget and context)."""
        p = self.policy
        k = best_k(p.costs.verify_s, p.costs.draft_cost(self.draft_key), p.costs.step_s, self.alpha,
                   min(p.k_max, limit))
        return self.settle(k, limit)

    def settle(self, k: int, limit: int) -> int:
        """The planned length k, or a probe token after enough idle steps."""
        p = self.policy
        self.probing = False
        if k == 0 and limit > 0:
            self.own.fade()
            self.idle_steps += 1
            if self.idle_steps >= (self.idle_limit or p.probe_every):
                self.idle_steps = 0
                self.probing = True
                return 1
        elif k > 0:
            self.idle_steps = 0
        return k

    def observe_costs(self, drafted: int, draft_s: float, step_s: float, teaches: bool) -> None:
        if not self.probing and teaches:
            self.policy.costs.observe_draft(self.draft_key, drafted, draft_s)
        self.policy.costs.observe_step(step_s)

    def observe(self, drafted: int, accepted: int) -> None:
        if self.probing:  # back off after a rejected probe, start over after an accepted one
            limit = self.idle_limit or self.policy.probe_every
            self.idle_limit = min(2 * limit, MAX_IDLE) if accepted == 0 else 0
            self.policy.idle_limit[self.draft_key] = self.idle_limit
        self.own.observe(drafted, accepted)
        self.shared.observe(drafted, accepted, decay=0.99)


def profile_forward(forward: Callable[[int], float], k_max: int, repeats: int = 5,
                    max_rows: int = 0, alone_rows: int = 0) -> list[float]:
    """V(t) for t = 1..max(k_max+1, alone_rows, max_rows): the median of `repeats` timed calls
    of forward(t) (which runs one target forward of t rows and returns its seconds), after one
    warm-up each. Every t up to k_max+1 is timed; beyond it doubling row counts up to
    alone_rows (a long chain's verify), then up to max_rows (a batched step's rows), and the
    rows between are interpolated linearly."""
    points = list(range(1, k_max + 2))
    t = k_max + 1
    for top in (alone_rows, max_rows):
        while t < top:
            t = min(2 * t, top)
            points.append(t)
    return _timed_profile(forward, points, repeats)


def _timed_profile(forward: Callable[[int], float], points: list[int], repeats: int) -> list[float]:
    timed = []
    for t in points:
        forward(t)
        times = sorted(forward(t) for _ in range(repeats))
        timed.append(times[len(times) // 2])
    out = []
    for (a, va), (b, vb) in zip(zip(points, timed), zip(points[1:], timed[1:])):
        out += [va + (vb - va) * (t - a) / (b - a) for t in range(a, b)]
    return out + [timed[-1]]

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

Pure: no torch, milliseconds to test with a fake profile.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

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
    v = list(verify_s)
    for i in range(len(v) - 2, -1, -1):
        v[i] = min(v[i], v[i + 1])
    best, best_rate = 0, 1.0 / (v[0] + step_s)
    for k in range(1, min(k_max, len(v) - 1) + 1):
        rate = expected_tokens(alpha, k) / (v[k] + k * draft_s + step_s)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


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

    def observe_step(self, seconds: float) -> None:
        if not self.frozen:
            self.step_s += EWMA * (seconds - self.step_s)


class KPolicy:
    """Per engine: the costs, each draft's acceptance across requests, and the choice per step."""

    def __init__(self, costs: StepCosts, k_max: int, probe_every: int = PROBE_EVERY):
        self.costs = costs
        self.k_max = k_max
        self.probe_every = probe_every
        self.by_draft: dict[object, Acceptance] = {}
        self.idle_limit: dict[object, int] = {}  # per draft: the probe back-off, carried across requests

    def new_request(self, draft_key: object) -> "RequestK":
        shared = self.by_draft.setdefault(draft_key, Acceptance())
        return RequestK(self, draft_key, Acceptance(weight=0.0), shared, idle_limit=self.idle_limit.get(draft_key, 0))


@dataclass
class RequestK:
    policy: KPolicy
    draft_key: object
    own: Acceptance
    shared: Acceptance
    idle_steps: int = 0
    idle_limit: int = 0  # steps at k = 0 before the next probe (0: probe_every)
    probing: bool = False

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

    def observe(self, drafted: int, accepted: int) -> None:
        if self.probing:  # back off after a rejected probe, start over after an accepted one
            limit = self.idle_limit or self.policy.probe_every
            self.idle_limit = min(2 * limit, MAX_IDLE) if accepted == 0 else 0
            self.policy.idle_limit[self.draft_key] = self.idle_limit
        self.own.observe(drafted, accepted)
        self.shared.observe(drafted, accepted, decay=0.99)


def profile_forward(forward: Callable[[int], float], k_max: int, repeats: int = 5) -> list[float]:
    """V(t) for t = 1..k_max+1: the median of `repeats` timed calls of forward(t) (which runs
    one target forward of t tokens and returns its seconds), after one warm-up each."""
    out = []
    for t in range(1, k_max + 2):
        forward(t)
        times = sorted(forward(t) for _ in range(repeats))
        out.append(times[len(times) // 2])
    return out

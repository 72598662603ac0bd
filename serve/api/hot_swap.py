"""Which draft each request gets, and swapping drafts under load without failing a request.

A replica holds a stable draft and optionally a canary with a traffic weight. A request
goes to the canary iff `canary_share(request_id) < weight`, so the
same request id always lands on the same arm. The choice is made when the request starts
and travels with it (SpecEngine's per-request `draft=`), so a swap only affects requests
that start after it; requests in flight finish on the draft they began with.

Versions come from the registry by id: the digests are checked before the safetensors are
read. A version whose digest fails, or that was made for another target (its recorded target
identity is not the replica's), is refused for good; one that fails for another reason (a
registry mount away, an object store timing out) is tried again after a doubling back-off
and refused for good only after `max_failures` failures (5). Meanwhile the replica
keeps serving what it had. Routing is one tuple replaced whole, so the request path never
sees half a swap.

The canary arm is chosen from the request id the server made, never from a header a client
sends: a client could otherwise pick its arm (and skew the canary's evidence).

Two ways to move the drafts, both ending in `apply()`:
- `follow_aliases()`: a background thread re-reads the registry's stable/canary aliases
  every `serve.alias_poll_s` (the default with `serve.draft: registry`);
- Serve's `reconfigure(user_config)` with {"stable", "canary", "canary_weight"}, which pins
  the versions and stops alias following (for RayService, where the config owns them).
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

# The longest wait between two loads of a version that keeps failing.
RETRY_CAP_S = 300.0


def canary_share(request_id: str) -> float:
    """A request's fixed position in [0, 1): routed to the canary iff below its weight."""
    return int(hashlib.sha256(request_id.encode()).hexdigest()[:12], 16) / float(1 << 48)


@dataclass(frozen=True)
class Routing:
    stable: str
    stable_runner: Any
    canary: str | None = None
    canary_runner: Any = None
    weight: float = 0.0


class DraftRouter:
    def __init__(self, load_runner: Callable[[str], Any], initial: Routing, log: Callable[[str], None] = print,
                 *, retry_base_s: float = 5.0, max_failures: int = 5, clock: Callable[[], float] = time.monotonic):
        self._load_runner = load_runner  # version id -> engine runner (raises on a bad version)
        self.routing = initial
        self._runners: dict[str, Any] = {initial.stable: initial.stable_runner}
        self.refused: dict[str, str] = {}  # version -> why its last load failed
        self._failures: dict[str, tuple[int, float]] = {}  # version -> (failures, next try at); absent: for good
        self._retry_base_s, self._max_failures, self._clock = retry_base_s, max_failures, clock
        self.loads = 0
        self.swaps = 0
        self._log = log
        self._lock = threading.Lock()  # one apply at a time (poller vs reconfigure)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def pick(self, request_id: str) -> tuple[str, Any]:
        r = self.routing  # one read: never half a swap
        if r.canary is not None and canary_share(request_id) < r.weight:
            return r.canary, r.canary_runner
        return r.stable, r.stable_runner

    def _runner(self, version: str) -> Any:
        if version in self._runners:
            return self._runners[version]
        if version in self.refused:
            if self._clock() < self._failures.get(version, (0, float("inf")))[1]:
                raise RuntimeError(self.refused[version])
        try:
            runner = self._load_runner(version)
        except Exception as e:
            self._refuse(version, e)
            raise RuntimeError(self.refused[version]) from None
        self.refused.pop(version, None)
        self._failures.pop(version, None)
        self.loads += 1
        self._runners[version] = runner
        return runner

    def _refuse(self, version: str, e: Exception) -> None:
        from infra.common.backoff import backoff_delay
        from infra.registry import DigestMismatch, WrongTarget

        failures = self._failures.get(version, (0, 0.0))[0] + 1
        self.refused[version] = f"{type(e).__name__}: {e}"
        if isinstance(e, (DigestMismatch, WrongTarget)) or failures >= self._max_failures:
            self._failures.pop(version, None)  # no retry: the same bytes fail the same way
            self._log(f"refused draft version {version} for good: {self.refused[version]}; keeping the current drafts")
            return
        delay = backoff_delay(failures, self._retry_base_s, RETRY_CAP_S)
        self._failures[version] = (failures, self._clock() + delay)
        self._log(f"draft version {version} failed to load ({failures}/{self._max_failures}): "
                  f"{self.refused[version]}; keeping the current drafts, trying again in {delay:.0f} s")

    def apply(self, stable: str | None, canary: str | None = None, weight: float = 0.0) -> bool:
        """Move to these versions; False (routing unchanged for a refused version) on failure."""
        with self._lock:
            cur = self.routing
            stable = stable or cur.stable
            if canary == stable or not weight:
                canary, weight = None, 0.0
            if (stable, canary, weight) == (cur.stable, cur.canary, cur.weight):
                return True
            try:
                s_runner = self._runner(stable)
                c_runner = self._runner(canary) if canary else None
            except RuntimeError:
                return False
            self.routing = Routing(stable, s_runner, canary, c_runner, float(weight))
            self.swaps += 1
            # Forget runners nothing routes to; requests in flight keep their own reference.
            live = {stable, canary}
            self._runners = {v: r for v, r in self._runners.items() if v in live}
            self._log(f"drafts now: stable {stable}" + (f", canary {canary} at {weight:.0%}" if canary else ""))
            return True

    def follow_aliases(self, read_aliases: Callable[[], dict[str, Any]], poll_s: float) -> None:
        def loop() -> None:
            while not self._stop.wait(poll_s):
                # Nothing a poll meets may end the thread: a registry hiccup or a malformed alias
                # file is logged and the next poll tries again, while the drafts stay as they are.
                try:
                    stable, canary, weight = aliases_target(read_aliases())
                    if stable:
                        self.apply(stable, canary, weight)
                except Exception as e:
                    self._log(f"following the registry aliases: {type(e).__name__}: {e}; keeping the current drafts")

        self._thread = threading.Thread(target=loop, name="osd-alias-poll", daemon=True)
        self._thread.start()

    def stop_following(self) -> None:
        self._stop.set()

    @property
    def following(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def check_health(self) -> None:
        """Raise if the alias poller was started, not stopped, and has died anyway."""
        if self._thread is not None and not self._stop.is_set() and not self._thread.is_alive():
            raise RuntimeError("the registry alias poller thread has died; drafts no longer follow the aliases")

    def runners(self) -> list[Any]:
        """Every runner held (stable, canary, loaded ones), each once: what record deletion clears."""
        r = self.routing
        held = (*self._runners.values(), r.stable_runner, r.canary_runner)
        return list({id(x): x for x in held if x is not None}.values())

    def state(self) -> dict[str, Any]:
        r = self.routing
        return {"stable": r.stable, "canary": r.canary, "canary_weight": r.weight, "loads": self.loads,
                "swaps": self.swaps, "refused": dict(self.refused), "following_aliases": self.following,
                "time": time.time()}


def aliases_target(aliases: dict[str, Any]) -> tuple[str | None, str | None, float]:
    """Registry aliases -> (stable, canary, weight) for DraftRouter.apply; ValueError when malformed."""
    stable, canary = aliases.get("stable"), aliases.get("canary")
    try:
        s = stable["version"] if stable else None
        if not canary:
            return s, None, 0.0
        weight = float(canary["weight"])
        version = canary["version"]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"malformed alias file (stable={stable!r}, canary={canary!r}): {e!r}") from None
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"canary weight {weight} is outside [0, 1]")
    return s, version, weight

"""The one back-off rule every retry loop here uses (trainer restarts, draft loads, standalone
training): base, 2 x base, 4 x base ... capped, so a long outage costs one try per cap."""


def backoff_delay(failures: int, base_s: float, cap_s: float) -> float:
    """Seconds to wait after the `failures`-th failure in a row (1, 2, ...)."""
    return min(cap_s, base_s * 2.0 ** min(max(failures, 1) - 1, 60))  # min(.., 60): no overflow

"""Small helpers that every layer shares and that import no other room of infra/: the retry
back-off (backoff.py), crash-durable writes (durable.py), named fault points for the fault
suite (faults.py), what this CPU does fast (cpu.py), the process reaper of a local stack
(reaper.py), the one percentile (stats.py) and the canary's estimators (canary_stats.py)."""

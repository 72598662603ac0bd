"""Client traffic against an OpenAI-compatible server: `osd replay` (replay.py: prompts at a
concurrency or a Poisson rate, summarised) and `osd demo` (demo.py: the closed loop on traffic
whose domain shifts, with its report)."""

"""Rollout: controller.py (the Ray actor that canaries each candidate, promotes or rolls back by
moving registry aliases) and canary_rule.py (its decision rule, pure functions)."""

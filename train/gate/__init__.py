"""Judging a candidate draft before it serves: α_est on held-out records (evaluator.py) and the
offline gate, the paired comparison with the current stable draft on the same records
(compare.py, pure numpy). Imports distill/ (and infra/)."""

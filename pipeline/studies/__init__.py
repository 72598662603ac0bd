"""Offline studies of drafts, each a table and JSON under reports/: `osd draft vocab-study`
(vocab_study.py: coverage of the target's answers by draft vocabularies) and `osd draft curve`
(draft_curve.py: held-out agreement of heads made at growing budgets)."""

"""The warm start's teacher: the target's own answers for a prompt set as records (data.py),
in large static batches (batch.py), with the head's features captured beside them
(features.py), cached on disk and grown across runs (store.py), split into train and held-out
(sets.py), with one progress bar (progress.py). Imports gate/ and distill/ (and infra/)."""

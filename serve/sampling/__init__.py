"""Sampling, pure over tensors: `verify` accepts draft tokens against the target (greedy and
rejection sampling, lossless), `processors` apply penalties and logit bias and return
log-probabilities, `bounds` are the parameters' limits (torch-free). Imports nothing else of
serve/."""

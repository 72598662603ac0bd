"""The bounds of the sampling parameters, torch-free so the API's request models can check them
before a request reaches the engine (serve/api/openai_protocol.py) and the processors again."""

PENALTY_RANGE = 2.0  # |presence_penalty| and |frequency_penalty| (vLLM's bound as well)
BIAS_RANGE = 100.0  # |logit_bias| values

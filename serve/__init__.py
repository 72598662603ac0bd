"""Serving: the speculative decoding engine, the Ray Serve deployments behind an OpenAI-compatible
endpoint, hot swap of draft versions, and the records each finished request writes."""

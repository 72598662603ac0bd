"""Serving: the speculative decoding engine and, later, the Ray Serve deployments."""

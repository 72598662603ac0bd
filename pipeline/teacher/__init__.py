"""The warm start's teacher: engine.py generates the target's answers through the serving
engine (continuous batching, the serving weight format), and feature_recorder.py captures the
target's features while it does, for the head draft."""

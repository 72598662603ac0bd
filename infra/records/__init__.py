"""The record of one served request and the Redis stream it travels on: the versioned Arrow
schema (schema.py, pure), the producer and consumer over Redis Streams (streams.py), the
token-level facts serving and training share (tokens.py), and deleting records on request
(match.py says which, deletion.py removes them and writes the audit entry). Imports
registry.py (the audit log), config.py and common/; never drafts/ or target.py directly."""

"""Redis as the platform runs it: the private redis-server started when no `stream.redis_url`
is set (server.py), least-privilege ACL users per role (acl.py), and the loop's live status
hash beside the stream (loop_status.py). Imports config.py only; not records/ (the stream's
own code lives there)."""

"""Least privilege on the record stream: one Redis ACL user per role.

The serving replicas only write records (producer), trainers and the rollout controller read,
ack and claim them (trainer), and deletion may remove them (admin). `acl_line` is the rule the
chart renders into the Redis's ACL file (helm/osd/templates/redis.yaml) and tests load into a
real redis-server; stream.users holds each role's username and password for the clients.
"""

from __future__ import annotations

import hashlib

# Beyond XADD the producer trims (retention, MAXLEN), rewrites the AOF after a retention trim
# (BGREWRITEAOF, so trimmed bytes leave the disk) and reads the trainers' backlog size (XINFO
# GROUPS, XLEN: counts, never a record). The trainer moves undecodable entries to the
# dead-letter stream (XADD there) and writes the loop's status hash and its start counts and
# times (HINCRBY, HSET: infra/redis/loop_status.py), which the ops page reads. A spooling producer
# writes each batch with its spool marker in MULTI/EXEC and reads a dead producer's marker
# (GET, SET on <stream>:spool:*, infra/records/spool.py): a number, never a record.
ROLE_COMMANDS = {
    "producer": "+ping +xadd +xtrim +xlen +xinfo|groups +bgrewriteaof +multi +exec +get +set",
    "trainer": "+ping +xreadgroup +xread +xrange +xrevrange +xlen +xack +xautoclaim +xclaim +xpending "
               "+xgroup|create +xinfo +xadd +hset +hincrby +hgetall",
    "admin": "+ping +xrange +xrevrange +xlen +xinfo +xdel +xtrim +hgetall",
}
ROLES = tuple(ROLE_COMMANDS)


def stream_keys(stream: str) -> list[str]:
    """The keys of one stream: the records, their dead letters, the loop's status hash, its
    start counts and times, the producers' spool markers."""
    return [stream, f"{stream}:dead", f"{stream}:status", f"{stream}:starts", f"{stream}:started_at",
            f"{stream}:spool:*"]


def acl_line(role: str, username: str, password: str, stream: str) -> str:
    """One `user` line of an ACL file; the password goes in as its SHA-256 (`#<hex>`), so the
    file never holds it in clear."""
    digest = hashlib.sha256(password.encode()).hexdigest()
    keys = " ".join(f"~{k}" for k in stream_keys(stream))
    return f"user {username} on #{digest} resetkeys {keys} resetchannels -@all {ROLE_COMMANDS[role]}"

"""`osd records delete`: remove a tenant's, a user's or a request's records from the stream and
its dead-letter stream, and write the audit entry (infra/records/deletion.py).

The running replicas' suffix indexes are in their memory, out of this process's reach: the
HTTP route (DELETE /v1/osd/records, admin key) clears those as well; this command says so.
"""

from __future__ import annotations

import argparse
import getpass
import sys

from infra.config import OSDConfig


def _cmd_records_delete(cfg: OSDConfig, args: argparse.Namespace) -> int:
    from infra.records.deletion import audit_deletion, delete_from_stream
    from infra.records.match import RecordMatch
    from infra.redis.server import resolve_redis_url

    try:
        match = RecordMatch(tenant=args.tenant, user=args.user, request_id=args.request_id)
    except ValueError as e:
        print(f"osd: error: {e} (--tenant, --user, --request-id)", file=sys.stderr)
        return 2
    cfg = cfg.model_copy(update={"stream": cfg.stream.model_copy(update={"redis_url": resolve_redis_url(cfg)})})
    deleted = delete_from_stream(cfg, match)
    audit_deletion(cfg, match, deleted, "cli", by=getpass.getuser())
    print(f"deleted {deleted.stream} record(s) from {cfg.stream.stream} and {deleted.dead_letters} dead letter(s); "
          f"audit entry written to {cfg.registry.uri or 'the registry'}")
    print("running replicas' suffix indexes are cleared by DELETE /v1/osd/records (admin key); a draft already "
          "trained on these records keeps what it learnt (docs/data-governance.md, 'how to delete it')")
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    rc = sub.add_parser("records", help="captured traffic: delete what a tenant, a user or a request left")
    rs = rc.add_subparsers(dest="records_op", required=True)
    de = rs.add_parser("delete", help="remove matching records from the stream and its dead letters, with an "
                                      "audit entry (every given field must match)")
    de.add_argument("--tenant", help="the tenant of the API key that made the requests")
    de.add_argument("--user", help="the OpenAI `user` field the requests named")
    de.add_argument("--request-id", help="one response's `id`")
    de.set_defaults(func=_cmd_records_delete)

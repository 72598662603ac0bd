"""`osd registry publish | list | show | promote | canary | rollback | gc`: draft versions and
the stable/canary aliases (registry.uri)."""

from __future__ import annotations

import argparse
import json
import time

from infra.config import OSDConfig


def _cmd_registry(cfg: OSDConfig, args: argparse.Namespace) -> int:
    from infra.registry import Registry

    reg = Registry.from_config(cfg)
    op = args.registry_op
    if op == "publish":
        from infra.target import identify_target

        # A draft made for another target than the configured one is refused here, not at serving.
        target_sha256 = identify_target(cfg.model.target, cfg.model, progress=True)
        v = reg.publish(args.dir, args.version, expect_target_sha256=target_sha256)
        print(f"published {v.id} ({v.size / 1e6:.1f} MB) to {reg.uri}")
    elif op == "list":
        aliases = {name: a["version"] for name, a in reg.aliases().items() if a}
        rows = [{"version": v.id, "created_at": v.created_at, "aliases": [n for n, x in aliases.items() if x == v.id],
                 "parent": v.lineage.get("parent"), "records": v.lineage.get("records_consumed"),
                 "alpha_est": v.metrics.get("alpha_est"), "size": v.size} for v in reg.list()]
        if args.json:
            print(json.dumps(rows, indent=2))
            return 0
        from tabulate import tabulate

        table = [[r["version"], time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r["created_at"])),
                  ",".join(r["aliases"]) or "-", r["parent"] or "-", "-" if r["records"] is None else r["records"],
                  "-" if r["alpha_est"] is None else f"{r['alpha_est']:.3f}"] for r in rows]
        print(tabulate(table, headers=["version", "created (UTC)", "aliases", "parent", "records", "alpha_est"],
                       disable_numparse=True, colalign=("left",) * 4 + ("right",) * 2))
        canary = reg.alias("canary")
        if canary:
            print(f"canary weight: {canary['weight']:.0%}")
    elif op == "show":
        v = reg.get(args.version)
        names = [n for n, a in reg.aliases().items() if a and a["version"] == v.id]
        print(json.dumps({"version": v.id, "created_at": v.created_at, "aliases": names, "lineage": v.lineage,
                          "metrics": v.metrics, "target": v.target, "files": v.files}, indent=2))
    elif op == "promote":
        body = reg.promote(args.version, reason="osd registry promote")
        reg.audit({"action": "promote", "version": body["version"], "reason": "osd registry promote", "manual": True})
        print(f"stable -> {body['version']} (previous {body['previous']}); canary cleared")
    elif op == "canary":  # a person's canary: the controller judges it, even one it rolled back before
        body = reg.set_canary(args.version, args.weight, reason="osd registry canary")
        reg.audit({"action": "canary", "version": body["version"], "weight": body["weight"],
                   "reason": "osd registry canary", "manual": True})
        print(f"canary -> {body['version']} at {body['weight']:.0%}")
    elif op == "rollback":
        out = reg.rollback(reason="osd registry rollback")
        if "dropped_canary" in out:
            print(f"dropped canary {out['dropped_canary']}; stable stays {out['stable']}")
        else:
            print(f"stable -> {out['stable']} (was {out['from']})")
    elif op == "gc":
        removed = reg.gc(args.keep_last if args.keep_last is not None else cfg.registry.keep_last)
        print(f"removed {len(removed)}: {', '.join(removed) or '-'}")
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    rg = sub.add_parser("registry", help="draft versions and the stable/canary aliases (registry.uri)")
    rs = rg.add_subparsers(dest="registry_op", required=True)
    pb = rs.add_parser("publish", help="copy a draft directory in as a new immutable version (the draft "
                                       "must have been made for model.target)")
    pb.add_argument("dir")
    pb.add_argument("--version", help="version id (default: the next vN)")
    ls = rs.add_parser("list", help="versions, oldest first, with their aliases and lineage")
    ls.add_argument("--json", action="store_true")
    rs.add_parser("show", help="one version's manifest").add_argument("version")
    rs.add_parser("promote", help="make a version stable (clears the canary)").add_argument("version")
    cn = rs.add_parser("canary", help="make a version the canary (the rollout controller then judges it)")
    cn.add_argument("version")
    cn.add_argument("--weight", type=float, default=0.1, help="traffic share in (0, 1] (default 0.1)")
    rs.add_parser("rollback", help="drop the canary, or else move stable back to its previous version "
                                   "(audited: the rollout controller will not canary that version again)")
    gc = rs.add_parser("gc", help="delete versions no alias names, beyond the newest N")
    gc.add_argument("--keep-last", type=int, metavar="N", help="at least 1; default registry.keep_last")
    rg.set_defaults(func=_cmd_registry)

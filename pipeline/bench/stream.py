"""How fast records move through the stream: encode, XADD, read, decode, ack on loopback.

Runs against its own private redis-server in a temp dir (same settings as the embedded
default: AOF, fsync every second), so a configured or running Redis is never touched and
the numbers are not mixed with other traffic. Producer thread and consumer share this
process (and its GIL), as a replica's producer shares it with serving; treat the end-to-end
rate as a floor.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tabulate import tabulate

from infra.config import OSDConfig
from infra.redis.server import RedisServer, RedisServerError
from infra.common.stats import percentile

if TYPE_CHECKING:  # pyarrow loads when the bench runs, not when the CLI lists its flags
    from infra.records.schema import Record


def synthetic_record(rng: np.random.Generator, tokens: int, top_k: int, vocab: int = 49152) -> Record:
    """A record shaped like real traffic: about 60% of positions came from accepted drafts."""
    from infra.records.schema import Record, new_record_id

    drafted = rng.random(tokens) < 0.8
    return Record(
        request_id=new_record_id(),
        draft_version="bench",
        domain="other",
        prompt_ids=rng.integers(0, vocab, 128).astype(np.int32),
        output_ids=rng.integers(0, vocab, tokens).astype(np.int32),
        topk_ids=rng.integers(0, vocab, (tokens, top_k)).astype(np.int32),
        topk_logprobs=np.sort(-rng.exponential(3.0, (tokens, top_k)), axis=1)[:, ::-1].astype(np.float16),
        accepted=drafted & (rng.random(tokens) < 0.75),
        draft_tokens=np.where(drafted, rng.integers(0, vocab, tokens), -1).astype(np.int32),
        draft_probs=np.where(drafted, rng.random(tokens), np.nan).astype(np.float32),
    )


def _p50_us(samples: list[float]) -> float:
    p50 = percentile(samples, 50)
    return float("nan") if p50 is None else p50 * 1e6


def run_stream_bench(cfg: OSDConfig, records: int = 2000, tokens: int = 256, top_k: int = 32,
                     json_path: str | Path | None = None, *, samples: int = 200, seed: int = 0,
                     spool: bool = False) -> dict[str, Any]:
    """Produce, consume and ack `records` records of tokens x top_k; print a table, return the figures
    (and write them as JSON to json_path if given). spool: the producer spools each record on
    disk in submit(), as a replica's does (infra/records/spool.py); submit's p50 is what a request pays."""
    from infra.records.schema import new_record_id
    from infra.records.streams import FIELD, QUEUE_SIZE, READ_COUNT, RecordConsumer, RecordProducer, connect

    rng = np.random.default_rng(seed)
    pool = [synthetic_record(rng, tokens, top_k) for _ in range(min(16, records))]
    samples = max(1, min(samples, records))
    # The bench must not drop: room for every record, no lag budget, nothing trimmed.
    scfg = cfg.stream.model_copy(update={
        "stream": "osd:bench", "group": "bench", "lag_budget": 0,
        "maxlen": max(cfg.stream.maxlen, records + 1),
    })

    enc, dec, payloads = _time_codec(pool, samples)
    size = float(np.mean([len(p) for p in payloads]))

    with tempfile.TemporaryDirectory(prefix="osd-bench-redis-") as tmp, RedisServer(tmp) as server:
        client = connect(server.url, scfg)
        xadd = []
        for p in payloads:  # one round trip each, as a producer without batching would pay
            t0 = time.perf_counter()
            client.xadd("osd:bench:xadd", {FIELD: p})
            xadd.append(time.perf_counter() - t0)
        client.delete("osd:bench:xadd")

        consumer = RecordConsumer(server.url, scfg, name="bench")
        producer = RecordProducer(server.url, scfg, queue_size=max(QUEUE_SIZE, records),
                                  spool_dir=Path(tmp) / "spool" if spool else None)
        got, submit = 0, []
        t0 = time.perf_counter()
        for i in range(records):
            rec = dataclasses.replace(pool[i % len(pool)], record_id=new_record_id())
            t1 = time.perf_counter()
            producer.submit(rec)
            submit.append(time.perf_counter() - t1)
        deadline = time.monotonic() + 300
        while got < records and time.monotonic() < deadline:
            batch = consumer.read(count=READ_COUNT)
            consumer.ack(batch)
            got += len(batch)
        elapsed = time.perf_counter() - t0
        producer.close()
        pstats, cstats = producer.stats(), consumer.stats()
        consumer.close()
        client.close()

    result = {
        "records": got,
        "tokens": tokens,
        "top_k": top_k,
        "bytes_per_record": int(round(size)),
        "records_per_s": got / elapsed,
        "mb_per_s": got * size / elapsed / 1e6,
        "encode_us_p50": _p50_us(enc),
        "decode_us_p50": _p50_us(dec),
        "xadd_us_p50": _p50_us(xadd),
        "spool": spool,
        "submit_us_p50": _p50_us(submit),
        "dropped": pstats.dropped_total,
        "duplicates": cstats.duplicates,
        "elapsed_s": elapsed,
    }
    _print_result(result, records)
    if json_path is not None:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
    return result


def _time_codec(pool: list, samples: int) -> tuple[list[float], list[float], list[bytes]]:
    """Seconds to encode `samples` records of the pool, to decode each payload, and the payloads."""
    from infra.records.schema import decode, encode

    enc, dec, payloads = [], [], []
    for i in range(samples):
        rec = pool[i % len(pool)]
        t0 = time.perf_counter()
        payloads.append(encode(rec))
        enc.append(time.perf_counter() - t0)
    for p in payloads:
        t0 = time.perf_counter()
        decode(p)
        dec.append(time.perf_counter() - t0)
    return enc, dec, payloads


def _print_result(result: dict[str, Any], records: int) -> None:
    """The bench's table, from its figures."""
    rows = [("records", f"{result['records']} of {records}"), ("bytes/record", f"{result['bytes_per_record']:,}"),
            ("records/s (produce+consume+ack)", f"{result['records_per_s']:,.0f}"),
            ("MB/s", f"{result['mb_per_s']:,.1f}"), ("encode p50 (us)", f"{result['encode_us_p50']:,.1f}"),
            ("decode p50 (us)", f"{result['decode_us_p50']:,.1f}"), ("XADD p50 (us)", f"{result['xadd_us_p50']:,.1f}"),
            (f"submit p50 (us){', spooled' if result['spool'] else ''}", f"{result['submit_us_p50']:,.1f}"),
            ("dropped", str(result["dropped"]))]
    print(f"stream bench: {result['tokens']} tokens x top-{result['top_k']}, loopback redis-server "
          "(AOF, appendfsync always)")
    for line in tabulate(rows, tablefmt="plain", disable_numparse=True, colalign=("left", "right")).splitlines():
        print(f"  {line}")


# -- the command line: `osd bench stream` ------------------------------------------------------

HELP = "records through a private loopback redis-server: encode, XADD, read, ack"
ERRORS = (RedisServerError,)


def add_arguments(bs: argparse.ArgumentParser) -> None:
    bs.add_argument("--records", type=int, default=2000, metavar="N", help="records to produce and consume (default 2000)")
    bs.add_argument("--tokens", type=int, default=256, metavar="N", help="positions per record (default 256)")
    bs.add_argument("--top-k", type=int, default=32, metavar="K", help="target top-k per position (default 32)")
    bs.add_argument("--spool", action="store_true",
                    help="the producer spools each record on disk as a replica's does (infra/records/spool.py)")
    bs.add_argument("--json", metavar="PATH", default="reports/bench/stream.json", help="where to write JSON")


def run(cfg: OSDConfig, args: argparse.Namespace) -> int:
    run_stream_bench(cfg, records=args.records, tokens=args.tokens, top_k=args.top_k, json_path=args.json,
                     spool=args.spool)
    return 0

"""`flashmoe-cli store`: inspect the telemetry store. Each subcommand is a thin wrapper over one
library call whose parameters its options name: store.queries.stats / export, Store.compact.

  flashmoe-cli store stats --db data/flashmoe.db [--json]
  flashmoe-cli store export --db data/flashmoe.db --series block.vda.util [--since T] [--until T] [--csv]
  flashmoe-cli store compact --db data/flashmoe.db [--retention-days 7]
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from store import queries
from store.db import Store
from store.errors import StoreError
from store.schema import DEFAULT_RETENTION_DAYS

log = logging.getLogger(__name__)


def positive(text: str) -> float:
    """A positive finite number (seconds, days): 0, a negative, nan, inf or 1e400 is a usage error."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive finite number, not {text}")
    return value


def parse_time(text: str) -> float:
    """Unix seconds, or an ISO 8601 date-time (UTC unless it names a zone)."""
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(seconds):
            raise argparse.ArgumentTypeError(f"{text!r} is not a time; give Unix seconds or an ISO 8601 time")
        return seconds
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither Unix seconds nor an ISO 8601 time "
                                         f"such as 2026-01-31T12:00:00") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


def _subcommand(sub: argparse._SubParsersAction, name: str, help_: str, example: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help_, description=help_, epilog=f"example:\n  {example}",
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = __doc__.split("\n\n", 1)[1]
    sub = parser.add_subparsers(dest="store_command", metavar="SUBCOMMAND", required=True)
    stats = _subcommand(sub, "stats", "per series: points, chunks, encoded bytes, bytes per point; "
                        "row counts of the other tables", "flashmoe-cli store stats --db data/flashmoe.db")
    stats.add_argument("--db", required=True, type=Path)
    stats.add_argument("--json", action="store_true", help="print JSON instead of a table")
    export = _subcommand(sub, "export", "decoded points of one series as JSON lines {t, value}, or CSV",
                         "flashmoe-cli store export --db data/flashmoe.db --series mem.free_bytes --csv")
    export.add_argument("--db", required=True, type=Path)
    export.add_argument("--series", required=True, help="series name, e.g. block.vda.util")
    export.add_argument("--since", type=parse_time, default=None, help="Unix seconds or ISO 8601 time")
    export.add_argument("--until", type=parse_time, default=None, help="Unix seconds or ISO 8601 time")
    export.add_argument("--csv", action="store_true", help="CSV with a header t,value")
    compact = _subcommand(sub, "compact", "delete data older than the retention and merge small chunks",
                          "flashmoe-cli store compact --db data/flashmoe.db --retention-days 7")
    compact.add_argument("--db", required=True, type=Path)
    compact.add_argument("--retention-days", type=positive, default=DEFAULT_RETENTION_DAYS,
                         help=f"delete data older than this (default {DEFAULT_RETENTION_DAYS:g})")


def _print_stats(report: dict) -> None:
    out = sys.stdout
    out.write(f"{'series':44} {'unit':>8} {'kind':>7} {'points':>9} {'chunks':>7} {'bytes':>9} {'B/pt':>6}\n")
    for s in report["series"]:
        out.write(f"{s['name']:44} {s['unit']:>8} {s['kind']:>7} {s['points']:>9} {s['chunks']:>7} "
                  f"{s['encoded_bytes']:>9} {s['bytes_per_point']:>6.2f}\n")
    out.write(f"{'all series':44} {'':>8} {'':>7} {report['points']:>9} {'':>7} "
              f"{report['encoded_bytes']:>9} {report['bytes_per_point']:>6.2f}\n")
    out.write("rows: " + ", ".join(f"{t} {n}" for t, n in report["rows"].items()) + "\n")
    out.write(f"file: {report['db']} {report['file_bytes']} bytes\n")


def run(args: argparse.Namespace) -> int:
    try:
        if args.store_command == "stats":
            report = queries.stats(args.db)
            if args.json:
                sys.stdout.write(json.dumps(report, indent=2) + "\n")
            else:
                _print_stats(report)
        elif args.store_command == "export":
            try:
                sys.stdout.writelines(queries.export(args.db, args.series, args.since, args.until, args.csv))
            except ValueError as e:   # a window that ends before it starts (store.queries checks it)
                log.error("--since/--until: %s", e)
                return 2
        else:
            with Store(args.db, autoflush_s=0, create=False) as store:
                report = store.compact(args.retention_days)
            sys.stdout.write(json.dumps(asdict(report)) + "\n")
    except StoreError as e:
        log.error("%s", e)
        return 1
    return 0

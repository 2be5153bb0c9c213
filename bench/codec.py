"""Bytes per point of the 8-bit delta codec vs raw, zlib and Gorilla on series recorded here.

    .venv/bin/python bench/codec.py                      # table + bench/results/codec.json
    .venv/bin/python bench/codec.py --make-fixture DB    # rewrite the fixture from a recording

The fixture tests/data/recorded_series.json was recorded on this machine by the collector itself
(`flashmoe-cli collect --db /tmp/rec.db --duration 900 --store-path .`, while seven other
programs built and tested FlashMoE on the same two cores), then its first 10 minutes of every
series exported with --make-fixture. Every codec sees the same points: raw is an 8-byte timestamp + 8-byte value;
zlib (level 9) and Gorilla (`gorillacompression`, f64 values, second timestamps) compress a whole
series as one block, their best case; ours is measured in chunks of 60 and 120 points and of 600
(the writer's open chunk, also the whole fixture; compaction makes 7200-point chunks of older
data). Our decode is checked against the input.
"""
from __future__ import annotations

import argparse
import json
import struct
import sys
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from gorillacompression import PairsEncoder

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import machine, write_results  # noqa: E402
from store import codec, queries  # noqa: E402
from store.series_writer import to_fixed  # noqa: E402
from store.schema import SeriesSpec  # noqa: E402

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "data" / "recorded_series.json"
CHUNKS = (60, 120, 600)


@dataclass
class Row:
    series: str
    points: int
    raw: int
    zlib: int
    gorilla: int
    ours_60: int
    ours_120: int
    ours_600: int


def load(path: Path) -> dict:
    """The fixture with absolute times (ms) and values (q x precision, as the store returns them)."""
    fixture = json.loads(path.read_text())
    for entry in fixture["series"].values():
        entry["t_ms"] = np.cumsum([fixture["t0_ms"]] + entry["dt_ms"])[1:].tolist()
        entry["values"] = queries.fixed_to_values(np.array(entry["q"], np.int64), entry["precision"]).tolist()
    return fixture


def ours(spec: SeriesSpec, t_ms: list[int], values: list[float], chunk: int) -> int:
    q = [to_fixed(v, spec) for v in values]
    size = 0
    for start in range(0, len(q), chunk):
        data = codec.encode(t_ms[start:start + chunk], q[start:start + chunk])
        decoded = codec.decode(data)
        back = decoded.q * spec.precision
        assert decoded.t_ms.tolist() == t_ms[start:start + chunk]
        assert np.all(np.abs(back - values[start:start + chunk]) <= spec.precision / 2 * (1 + 1e-9))
        size += len(data)
    return size


def measure(name: str, entry: dict) -> Row:
    spec = SeriesSpec(name, entry["unit"], entry["kind"], entry["precision"])
    t_ms, values = entry["t_ms"], entry["values"]
    n = len(values)
    raw = b"".join(struct.pack("<qd", t, v) for t, v in zip(t_ms, values))
    gorilla = PairsEncoder.encode_all(zip((t // 1000 for t in t_ms), values))["encoded"]
    return Row(name, n, len(raw), len(zlib.compress(raw, 9)), len(gorilla),
               *(ours(spec, t_ms, values, chunk) for chunk in CHUNKS))


def make_fixture(db: Path, out: Path, seconds: float = 600.0) -> None:
    """Export every series of a collector recording, its first `seconds`, to the fixture: times
    as ms steps (the first from t0_ms), values as the fixed-point integers the store keeps."""
    series = {}
    infos = [i for i in queries.series_info(db) if i.points]
    t0 = min(i.t_first for i in infos)
    t0_ms = round(t0 * 1000)
    for info in infos:
        t, v = queries.points(db, info.name, t0, t0 + seconds - 0.001)
        t_ms = [round(x * 1000) for x in t.tolist()]
        series[info.name] = {"unit": info.unit, "kind": info.kind, "precision": info.precision,
                             "dt_ms": np.diff([t0_ms] + t_ms).tolist(),
                             "q": [round(x / info.precision) for x in v.tolist()]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"recorded_with": "flashmoe-cli collect --interval 1 (see bench/codec.py)",
                               "machine": machine(), "t0_ms": t0_ms, "seconds": seconds, "series": series},
                              separators=(",", ":")) + "\n")


def report(rows: list[Row]) -> dict:
    columns = ("raw", "zlib", "gorilla", "ours_60", "ours_120", "ours_600")
    print(f"{'series':36} {'points':>6} " + " ".join(f"{c:>10}" for c in columns) + "   (bytes/point)")
    for r in rows:
        print(f"{r.series:36} {r.points:>6} " + " ".join(f"{getattr(r, c) / r.points:>10.3f}" for c in columns))
    total_points = sum(r.points for r in rows)
    totals = {c: sum(getattr(r, c) for r in rows) / total_points for c in columns}
    print(f"{'ALL':36} {total_points:>6} " + " ".join(f"{totals[c]:>10.3f}" for c in columns))
    ratios = {f"{c}_vs_ours_600": totals[c] / totals["ours_600"] for c in ("raw", "zlib", "gorilla")}
    print("ratios (bytes of the other / bytes of ours at 600-point chunks): "
          + ", ".join(f"{k.split('_vs')[0]} {v:.2f}x" for k, v in ratios.items()))
    return {"bytes_per_point": totals, "ratios": ratios, "series": [asdict(r) for r in rows]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fixture", type=Path, default=FIXTURE)
    parser.add_argument("--make-fixture", type=Path, metavar="DB", help="export this recording first")
    args = parser.parse_args()
    if args.make_fixture:
        make_fixture(args.make_fixture, args.fixture)
    fixture = load(args.fixture)
    rows = [measure(name, entry) for name, entry in sorted(fixture["series"].items())]
    result = report(rows) | {"fixture": str(args.fixture), "recorded_on": fixture["machine"],
                             "machine": machine()}
    write_results("codec", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

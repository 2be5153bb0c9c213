"""CPU cost of `flashmoe-cli collect` at 1 Hz, measured from outside over >= 60 s.

    .venv/bin/python bench/collector_cost.py [--seconds 60] [--interval 1]
    .venv/bin/python bench/collector_cost.py --readers --compare-with /tmp/main-src   # JSON: collector_cost-readers

Runs the real collector on this machine's devices into a temporary store, skips its start-up
(imports, device discovery), then reads utime + stime of the process from /proc/<pid>/stat at the
start and end of the measured window. Side by side: the goal (1% of one core), the collector's own
`collector.cpu_fraction` series over the same window, the CPU per tick, and its resident memory.

--readers gives the collector an agent to watch and a disk that others read, so that it splits the
disk's reads and looks for the readers every tick (collector.samplers.DiskReadersSampler, its most
expensive case): a stand-in agent (a process reading a 64 MiB file with O_DIRECT, 1 MiB every 10 ms,
its pid file passed with --pid-file) and a neighbour (`dd` O_DIRECT reads of another 64 MiB file, over
and over) on the disk of the temporary directory. --compare-with DIR measures DIR's collector (e.g.
`git archive main | tar -x -C DIR`) the same way right after, so the two are side by side in one run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.common import machine, write_results  # noqa: E402
from bench.processes import started  # noqa: E402

GOAL = 0.01
WARMUP_S = 5.0
TICK = os.sysconf("SC_CLK_TCK")
MIB = 1 << 20
STAND_IN_AGENT = """
import mmap, os, sys, time
fd, buf = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECT), mmap.mmap(-1, 1 << 20)
while True:
    for off in range(0, 64 << 20, 1 << 20):
        os.preadv(fd, [buf], off)
        time.sleep(0.01)
"""
# The store read by the measured checkout's own reader (its schema version may differ from this one's).
COUNTS = """
import json, sys
import numpy as np
from store import queries
db, lo, hi = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
_, own = queries.points(db, "collector.cpu_fraction", lo, hi)
print(json.dumps({"self_reported_mean": float(np.mean(own)) if len(own) else None,
                  "ticks": len(queries.points(db, "mem.free_bytes", lo, hi)[0]),
                  "points": sum(len(queries.points(db, name, lo, hi)[0]) for name in queries.series_names(db))}))
"""


def cpu_seconds(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[14 - 3]) + int(fields[15 - 3])) / TICK      # utime, stime (proc(5))


def rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) * 1024


@contextmanager
def readers(tmp: Path):
    """The stand-in agent and the dd neighbour running; yields the agent's pid file."""
    ours, theirs = tmp / "experts.bin", tmp / "other.bin"
    for path in (ours, theirs):
        subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=1M", "count=64", "conv=fsync"], check=True,
                       capture_output=True)
    with started([sys.executable, "-c", STAND_IN_AGENT, str(ours)]) as agent, \
            started(["sh", "-c", f"while :; do dd if={theirs} of=/dev/null bs=1M iflag=direct 2>/dev/null; done"],
                    start_new_session=True):
        pid_file = tmp / "agent.pid"
        pid_file.write_text(f"{agent.pid}\n")
        yield pid_file


def measure(root: Path, seconds: float, interval: float, pid_file: Path | None) -> dict:
    """The collector of the checkout at `root` over `seconds`, after its start-up."""
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "flashmoe.db"
        watch = ["--pid-file", str(pid_file)] if pid_file else []
        with started([sys.executable, "-m", "agent.cli", "collect", "--db", str(db), "--interval", str(interval),
                      "--store-path", tmp, *watch], stop_s=30, cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                     stderr=subprocess.DEVNULL) as proc:
            time.sleep(WARMUP_S)
            wall0, cpu0 = time.time(), cpu_seconds(proc.pid)
            time.sleep(seconds)
            wall1, cpu1 = time.time(), cpu_seconds(proc.pid)
            rss_bytes = rss(proc.pid)
        counts = json.loads(subprocess.run([sys.executable, "-c", COUNTS, str(db), str(wall0), str(wall1)], cwd=root,
                                           env={**os.environ, "PYTHONPATH": str(root)}, check=True,
                                           capture_output=True, text=True).stdout)
    fraction = (cpu1 - cpu0) / (wall1 - wall0)
    return {"root": str(root), "window_s": wall1 - wall0, "cpu_s": cpu1 - cpu0,
            "cpu_fraction_of_one_core": fraction, "fraction_over_goal": fraction / GOAL, **counts,
            "rss_bytes": rss_bytes, "cpu_ms_per_tick": 1000 * (cpu1 - cpu0) / max(counts["ticks"], 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--readers", action="store_true", help="a stand-in agent and a dd neighbour reading the disk")
    parser.add_argument("--compare-with", type=Path, default=None, help="another checkout's collector, measured next")
    args = parser.parse_args()
    roots = [ROOT] + ([args.compare_with.resolve()] if args.compare_with else [])
    with tempfile.TemporaryDirectory() as tmp:
        with readers(Path(tmp)) if args.readers else _nothing() as pid_file:
            runs = [measure(root, args.seconds, args.interval, pid_file) for root in roots]
    result = {**runs[0], "interval_s": args.interval, "goal": GOAL, "readers": args.readers, "runs": runs,
              "clock_tick_s": 1 / TICK, "machine": machine()}
    if len(runs) == 2:
        result["cpu_ratio_this_over_other"] = runs[0]["cpu_s"] / runs[1]["cpu_s"] if runs[1]["cpu_s"] else None
    print(f"{'measure':34} " + " ".join(f"{Path(r['root']).name[-12:]:>12}" for r in runs))
    for label, key, fmt in (("window (s)", "window_s", "{:12.1f}"), ("ticks", "ticks", "{:12d}"),
                            ("points written", "points", "{:12d}"), ("CPU (utime+stime, s)", "cpu_s", "{:12.2f}"),
                            ("CPU, share of one core", "cpu_fraction_of_one_core", "{:12.4%}"),
                            ("CPU per tick (ms)", "cpu_ms_per_tick", "{:12.2f}"),
                            ("collector RSS (MB)", "rss_bytes", "{:12.0f}")):
        print(f"{label:34} " + " ".join(fmt.format(r[key] / 1e6 if key == "rss_bytes" else r[key]) for r in runs))
    print(f"{'goal':34} {GOAL:>12.2%}")
    write_results("collector_cost" + ("-readers" if args.readers else ""), result)
    return 0


@contextmanager
def _nothing():
    yield None


if __name__ == "__main__":
    sys.exit(main())

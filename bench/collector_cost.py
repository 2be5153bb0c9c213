"""CPU cost of `flashmoe-cli collect` at 1 Hz, measured from outside over >= 60 s.

    .venv/bin/python bench/collector_cost.py [--seconds 60] [--interval 1]

Runs the real collector on this machine's devices into a temporary store, skips its start-up
(imports, device discovery), then reads utime + stime of the process from /proc/<pid>/stat at the
start and end of the measured window. Side by side: the goal (1% of one core), the collector's own
`collector.cpu_fraction` series over the same window, the CPU per tick, and its resident memory.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import machine, write_results  # noqa: E402
from store import queries  # noqa: E402

GOAL = 0.01
WARMUP_S = 5.0
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[14 - 3]) + int(fields[15 - 3])) / TICK      # utime, stime (proc(5))


def rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) * 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--interval", type=float, default=1.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "flashmoe.db"
        proc = subprocess.Popen([sys.executable, "-m", "agent.cli", "collect", "--db", str(db),
                                 "--interval", str(args.interval), "--store-path", tmp],
                                stderr=subprocess.DEVNULL)
        try:
            time.sleep(WARMUP_S)
            wall0, cpu0 = time.time(), cpu_seconds(proc.pid)
            time.sleep(args.seconds)
            wall1, cpu1 = time.time(), cpu_seconds(proc.pid)
            rss_bytes = rss(proc.pid)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
        _, own = queries.points(db, "collector.cpu_fraction", wall0, wall1)
        ticks = len(queries.points(db, "mem.free_bytes", wall0, wall1)[0])
        points = sum(len(queries.points(db, name, wall0, wall1)[0]) for name in queries.series_names(db))
    fraction = (cpu1 - cpu0) / (wall1 - wall0)
    result = {"interval_s": args.interval, "window_s": wall1 - wall0, "cpu_s": cpu1 - cpu0,
              "cpu_fraction_of_one_core": fraction, "goal": GOAL, "fraction_over_goal": fraction / GOAL,
              "self_reported_mean": float(np.mean(own)) if len(own) else None,
              "rss_bytes": rss_bytes, "ticks": ticks, "points": points, "cpu_ms_per_tick": 1000 * (cpu1 - cpu0) / max(ticks, 1),
              "clock_tick_s": 1 / TICK, "machine": machine()}
    print(f"{'measure':34} {'value':>10}")
    print(f"{'window (s)':34} {result['window_s']:>10.1f}")
    print(f"{'ticks / points written':34} {ticks:>5} / {points:<6}")
    print(f"{'CPU (utime+stime, s)':34} {result['cpu_s']:>10.2f}")
    print(f"{'CPU, share of one core':34} {fraction:>10.4%}")
    print(f"{'goal':34} {GOAL:>10.2%}")
    print(f"{'measured / goal':34} {result['fraction_over_goal']:>10.2f}")
    if result["self_reported_mean"] is not None:
        print(f"{'collector.cpu_fraction (own) mean':34} {result['self_reported_mean']:>10.4%}")
    print(f"{'CPU per tick (ms)':34} {result['cpu_ms_per_tick']:>10.2f}")
    print(f"{'collector RSS (MB)':34} {rss_bytes / 1e6:>10.1f}")
    write_results("collector_cost", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

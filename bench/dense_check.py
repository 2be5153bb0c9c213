"""Reading dense.safetensors at load, checked, against the raw read of the same file and the reference library.

    .venv/bin/python bench/dense_check.py --model /work/models/olmoe-1b-7b-int8 [--rounds 3] [--results NAME]

Each round, each read from a cold page cache (posix_fadvise DONTNEED): the file read raw with O_DIRECT
(the device's limit: one 16 MiB stream), the one pass loading does (agent/convert/safetensors_io.py's
read_tensors: every tensor read into the process and the file's crc32 taken over the same bytes), the
two passes it replaced (a crc32 pass, then safetensors' own load_file served from the page cache the pass
filled), and safetensors' load_file alone, unchecked. Beside each read's seconds, the page cache's
largest growth while it ran (/proc/meminfo's Cached, sampled every 10 ms: machine-wide, so read it on a
quiet machine): memory the read holds beside the process's one copy of the tensors, charged to its cgroup.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # the repo, so `bench` imports as a script

from agent.argtypes import count  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from agent.convert.safetensors_io import read_tensors  # noqa: E402
from agent.experts.layout import DENSE, drop_page_cache, file_crc32  # noqa: E402
from bench.common import machine, results_name, write_results  # noqa: E402
from machine.memory import parse_kib_table  # noqa: E402

CHUNK = 16 * 2**20


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def cached_bytes() -> int:
    return parse_kib_table(Path("/proc/meminfo").read_text())["Cached"]


def timed_cold(path: Path, fn) -> tuple[float, int]:
    """(seconds, the page cache's largest growth in bytes) of fn() from a cold page cache, which it leaves cold."""
    drop_page_cache(path)
    base, peak, done = cached_bytes(), [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.01):
            peak[0] = max(peak[0], cached_bytes() - base)
    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        took = seconds(fn)
    finally:
        done.set()
        sampler.join()
    drop_page_cache(path)
    return took, peak[0]


def raw_direct_read(path: Path) -> float:
    """Seconds to read the whole file with O_DIRECT in 16 MiB requests (dd: bench/loader.py's reader
    needs an aligned length, which a dense file's is not)."""
    return seconds(lambda: subprocess.run(["dd", f"if={path}", "of=/dev/null", f"bs={CHUNK}", "iflag=direct"],
                                          capture_output=True, check=True))


def one_round(path: Path) -> dict[str, float]:
    raw_s = raw_direct_read(path)
    one_pass, one_pass_cache = timed_cold(path, lambda: read_tensors(path))
    two_passes, two_passes_cache = timed_cold(path, lambda: (file_crc32(path), load_file(str(path), backend="pread")))
    load_cold, load_cache = timed_cold(path, lambda: load_file(str(path), backend="pread"))
    return {"raw_direct_s": raw_s, "one_pass_s": one_pass, "two_passes_s": two_passes, "load_file_cold_s": load_cold,
            "one_pass_cache_bytes": one_pass_cache, "two_passes_cache_bytes": two_passes_cache,
            "load_file_cache_bytes": load_cache}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="an expert store")
    p.add_argument("--rounds", type=count, default=3)
    p.add_argument("--results", type=results_name, help="write bench/results/NAME.json")
    args = p.parse_args()
    path = args.model / DENSE
    if not path.is_file():
        p.error(f"{path} is not a file: --model must be an expert store (flashmoe-cli convert writes one)")
    rounds = [one_round(path) for _ in range(args.rounds)]
    mb = path.stat().st_size / 1e6
    for r in rounds:
        print(f"raw O_DIRECT {mb / r['raw_direct_s']:.0f} MB/s ({r['raw_direct_s']:.2f} s); one pass, checked "
              f"{r['one_pass_s']:.2f} s ({r['one_pass_s'] / r['raw_direct_s']:.2f}x raw, page cache "
              f"+{r['one_pass_cache_bytes'] / 1e6:.0f} MB); crc pass + load_file {r['two_passes_s']:.2f} s "
              f"({r['two_passes_s'] / r['one_pass_s']:.2f}x the one pass, +{r['two_passes_cache_bytes'] / 1e6:.0f} "
              f"MB); load_file alone, unchecked {r['load_file_cold_s']:.2f} s "
              f"(+{r['load_file_cache_bytes'] / 1e6:.0f} MB)")
    summary = {k: median(r[k] for r in rounds) for k in rounds[0]}
    print(f"medians: {summary}")
    if args.results:
        write_results(args.results, {"machine": machine(), "file": str(path), "bytes": path.stat().st_size,
                                     "rounds": rounds, "medians": summary})


if __name__ == "__main__":
    main()

"""What checking dense.safetensors' crc32 adds to loading a model, against the raw read of the same file.

    .venv/bin/python bench/dense_check.py --model /work/models/olmoe-1b-7b-int8 [--rounds 3] [--results NAME]

Each round, from a cold page cache (posix_fadvise DONTNEED): the file read raw with O_DIRECT (the
device's limit, bench/loader.py's best of one and 8 streams), the crc32 pass loading now does
(agent/model/loading.py), the tensors read right after it (served from the page cache the pass filled),
and read cold, which is what loading would cost without the check. The added start-up time is
crc cold + load after - load cold.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # the repo, so `bench` imports as a script

from agent.argtypes import count  # noqa: E402
from agent.experts.layout import DENSE, drop_page_cache, file_crc32  # noqa: E402
from agent.model.loading import read_dense  # noqa: E402
from bench.common import machine, results_name, write_results  # noqa: E402

CHUNK = 16 * 2**20


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def raw_direct_read(path: Path) -> float:
    """Seconds to read the whole file with O_DIRECT in 16 MiB requests (dd: bench/loader.py's reader
    needs an aligned length, which a dense file's is not)."""
    return seconds(lambda: subprocess.run(["dd", f"if={path}", "of=/dev/null", f"bs={CHUNK}", "iflag=direct"],
                                          capture_output=True, check=True))


def one_round(path: Path) -> dict[str, float]:
    raw_s = raw_direct_read(path)
    drop_page_cache(path)
    crc_cold = seconds(lambda: file_crc32(path))
    load_after = seconds(lambda: read_dense(path))
    drop_page_cache(path)
    load_cold = seconds(lambda: read_dense(path))
    return {"raw_direct_s": raw_s, "crc_cold_s": crc_cold, "load_after_crc_s": load_after,
            "load_cold_s": load_cold, "added_s": crc_cold + load_after - load_cold}


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
        print(f"raw O_DIRECT {mb / r['raw_direct_s']:.0f} MB/s ({r['raw_direct_s']:.2f} s), crc cold "
              f"{r['crc_cold_s']:.2f} s ({r['crc_cold_s'] / r['raw_direct_s']:.2f}x raw), load after "
              f"{r['load_after_crc_s']:.2f} s, load cold {r['load_cold_s']:.2f} s: added {r['added_s']:.2f} s")
    summary = {k: median(r[k] for r in rounds) for k in ("raw_direct_s", "crc_cold_s", "load_cold_s", "added_s")}
    print(f"medians: {summary}")
    if args.results:
        write_results(args.results, {"machine": machine(), "file": str(path), "bytes": path.stat().st_size,
                                     "rounds": rounds, "medians": summary})


if __name__ == "__main__":
    main()

"""Loader vs device: expert-miss read throughput through ExpertCache beside a raw O_DIRECT read of the same file.

    .venv/bin/python bench/loader.py [--model DIR] [--repeat 3]

Every cache access is a miss: the cap is the smallest allowed (top-k slots per layer) and one
sweep routes every (layer, expert) block exactly once, top-k experts per step, in file order
("sequential") and in a seeded shuffled order per layer ("shuffled"). The raw reference reads the
whole experts.bin sequentially with O_DIRECT in large aligned chunks, in the same run: each
configuration's sweep directly follows a raw read, and its ratio is the median over rounds of
these adjacent pairs (the machine is shared; pairing cancels most of the load's drift). MB/s is
the median over rounds. O_DIRECT needs no cache dropping; the buffered and mmap backends start
cold because the file's pages are dropped with posix_fadvise(DONTNEED) before each of their sweeps.

--model defaults to the default demo model, written once by init-demo to data/loader-demo (a private
copy: see bench_store).
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from agent.demo import init_demo
from agent.experts.cache import ExpertCache
from agent.experts.cap import cap_bounds
from agent.experts.layout import CONFIG, EXPERTS, INDEX, Index
from agent.experts.reader import MmapReader

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.common import machine, write_results  # noqa: E402

DEMO = ROOT / "data" / "loader-demo"


@dataclass
class Row:
    config: str
    mb_s: float           # median over rounds, MB = 10^6 bytes
    ratio: float          # median of (this / the raw O_DIRECT read measured just before it)
    rounds_mb_s: list[float]  # every sample (the raw read has one per paired sweep)


# -- the store -------------------------------------------------------------------------------------------
def bench_store(model: Path | None) -> Path:
    """The given store, else a private copy of the default demo model (512 blocks of 3 MiB, 1.5 GiB).

    Private because another process mapping data/demo (a running agent, the decode bench) keeps its
    pages in the page cache, and the buffered and mmap sweeps could not start cold."""
    return model if model is not None else init_demo(DEMO, "default")


def drop_from_page_cache(store: Path, index: Index, attempts: int = 5) -> None:
    """Start cold: drop experts.bin's pages and check (mincore) that they are gone; readahead still in
    flight when the previous sweep ended can land just after a drop, hence a few attempts."""
    total = index.nbytes * len(index.blocks)
    for _ in range(attempts):
        fd = os.open(store / EXPERTS, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        probe = MmapReader(store / EXPERTS, index)
        left = sum(probe.resident_bytes(b) for b in index.blocks)
        probe.close()
        if left <= 0.01 * total:
            return
        time.sleep(0.2)
    raise RuntimeError(f"{left} bytes of {store / EXPERTS} stay in the page cache after DONTNEED (mapped "
                       f"elsewhere?); the buffered and mmap sweeps would not start cold")


# -- the measurements --------------------------------------------------------------------------------------
def raw_direct_read(path: Path, chunk_bytes: int) -> float:
    """Seconds to read the whole file sequentially with O_DIRECT into one page-aligned buffer."""
    buf = mmap.mmap(-1, chunk_bytes)
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        offset, start = 0, time.perf_counter()
        while n := os.preadv(fd, [view], offset):
            offset += n
        elapsed = time.perf_counter() - start
    finally:
        os.close(fd)
        view.release()
        buf.close()
    assert offset == path.stat().st_size, "raw read ended early"
    return elapsed


def schedule(index: Index, top_k: int, shuffled: bool) -> Iterator[tuple[int, list[int]]]:
    """Each step: (layer, top-k experts); over a sweep every block appears exactly once."""
    rng = np.random.default_rng(1)
    for layer in range(index.n_layers):
        order = rng.permutation(index.n_experts).tolist() if shuffled else list(range(index.n_experts))
        for i in range(0, len(order), top_k):
            yield layer, order[i:i + top_k]


def cache_sweep(store: Path, backend: str, verify: bool, shuffled: bool, io_threads: int) -> float:
    """Seconds for one all-miss sweep through ExpertCache; checks that every block was read once."""
    index = Index.load(store / INDEX)
    top_k = json.loads((store / CONFIG).read_text())["num_experts_per_tok"]
    if backend != "direct":
        drop_from_page_cache(store, index)
    with ExpertCache(store, cap_bounds(index, top_k)[0], backend=backend, verify=verify,
                     io_threads=io_threads) as cache:
        start = time.perf_counter()
        for layer, experts in schedule(index, top_k, shuffled):
            cache.route(layer, experts)
            for e in experts:
                cache.get(layer, e)
        elapsed = time.perf_counter() - start
        stats = cache.stats()
    assert stats.misses == stats.reads == len(index.blocks) and stats.hits == 0, stats
    return elapsed


def configurations(store: Path, chunk_bytes: int, io_threads: int) -> dict[str, tuple[Callable[[], float], int]]:
    """name -> (measurement returning seconds, bytes it moves)."""
    index = Index.load(store / INDEX)
    payload = index.nbytes * len(index.blocks)
    configs = {"raw O_DIRECT sequential": (lambda: raw_direct_read(store / EXPERTS, chunk_bytes),
                                           (store / EXPERTS).stat().st_size)}
    for backend, verify, shuffled in [("direct", True, False), ("direct", False, False), ("direct", True, True),
                                      ("buffered", True, False), ("mmap", True, False), ("mmap", True, True)]:
        name = f"cache {backend}, crc {'on' if verify else 'off'}, {'shuffled' if shuffled else 'sequential'}"
        configs[name] = (lambda b=backend, v=verify, s=shuffled: cache_sweep(store, b, v, s, io_threads), payload)
    return configs


def run(store: Path, repeat: int, chunk_bytes: int, io_threads: int) -> list[Row]:
    """Each configuration is measured right after its own raw read, so a pair shares the machine's load."""
    configs = configurations(store, chunk_bytes, io_threads)
    raw_name, (raw_measure, raw_bytes) = next(iter(configs.items()))
    samples: dict[str, list[float]] = {name: [] for name in configs}
    ratios: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(repeat):
        for name, (measure, nbytes) in list(configs.items())[1:]:
            raw = raw_bytes / raw_measure() / 1e6
            mine = nbytes / measure() / 1e6
            samples[raw_name].append(raw)
            samples[name].append(mine)
            ratios[name].append(mine / raw)
    ratios[raw_name] = [1.0]
    return [Row(name, statistics.median(samples[name]), statistics.median(ratios[name]),
                [round(x, 1) for x in samples[name]]) for name in configs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="an expert store (default: the demo model in data/loader-demo)")
    parser.add_argument("--repeat", type=int, default=3, help="interleaved rounds; the median is reported")
    parser.add_argument("--chunk-mb", type=int, default=16, help="raw read chunk size in MiB")
    parser.add_argument("--io-threads", type=int, default=4)
    args = parser.parse_args()
    store = bench_store(args.model)
    index = Index.load(store / INDEX)
    rows = run(store, args.repeat, args.chunk_mb * 2**20, args.io_threads)
    facts = machine(store)
    print(f"\nstore {store}: {len(index.blocks)} blocks of {index.nbytes / 2**20:.2f} MiB, "
          f"{(store / EXPERTS).stat().st_size / 2**30:.2f} GiB; raw chunk {args.chunk_mb} MiB; "
          f"{args.io_threads} io threads; median of {args.repeat}")
    print(f"machine: {facts['cpu']}, {facts['cores']} cores, {facts['ram_bytes'] / 2**30:.1f} GiB RAM, "
          f"{facts['filesystem']}, kernel {facts['kernel']}, DIO alignment {facts['dio_alignment']}\n")
    width = max(len(r.config) for r in rows)
    print(f"{'configuration':<{width}}  {'MB/s':>8}  {'x raw':>6}  {'min-max MB/s':>13}")
    for r in rows:
        spread = f"{min(r.rounds_mb_s):.0f}-{max(r.rounds_mb_s):.0f}"
        print(f"{r.config:<{width}}  {r.mb_s:>8.0f}  {r.ratio:>6.2f}  {spread:>13}")
    print("\ndirect bypasses the page cache; buffered and mmap start cold (posix_fadvise DONTNEED before each sweep).")
    print()
    write_results("loader", {"store": str(store), "blocks": len(index.blocks), "block_bytes": index.nbytes,
                             "file_bytes": (store / EXPERTS).stat().st_size, "repeat": args.repeat,
                             "chunk_bytes": args.chunk_mb * 2**20, "io_threads": args.io_threads,
                             "machine": facts, "rows": [asdict(r) for r in rows]})


if __name__ == "__main__":
    main()

"""Loader vs device: expert-miss read throughput through ExpertCache beside a raw O_DIRECT read of the same file.

    .venv/bin/python bench/loader.py [--model DIR] [--repeat 4] [--io-threads 8]

Every cache access is a miss: the cap is the smallest allowed (top-k slots per layer) and one
sweep routes every (layer, expert) block exactly once, top-k experts per step, in file order
("sequential") and in a seeded shuffled order per layer ("shuffled"). The raw reference reads the
whole experts.bin with O_DIRECT in large aligned chunks at the device's best parallelism: one
stream, and as many concurrent streams (each a contiguous share of the file) as the cache has I/O
threads, whichever is faster in that round. Each configuration's sweep is paired with its own raw
read (the machine is shared; pairing cancels most of the load's drift), the sweep after the raw read
in even rounds and before it in odd ones (on a virtual disk a read's rate can depend on the reads
just before it; alternating cancels that over an even --repeat), and every column comes from
the same pairs: a configuration's MB/s and its raw MB/s are bytes over seconds summed over its
rounds, and the ratio is their quotient. O_DIRECT needs no cache dropping; the buffered and mmap
backends start cold because the file's pages are dropped with posix_fadvise(DONTNEED) before each
of their sweeps.

A virtual disk may serve "cold" O_DIRECT reads from the host's own cache: the bench reads one
region twice and reports both rates, so a table can say whether the device or the host's RAM was
measured.

--model defaults to the default demo model, written once by init-demo to data/loader-demo (a private
copy: see bench_store).
"""
from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import queue
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from agent.demo import init_demo
from agent.experts.cache import ExpertCache
from agent.experts.cap import cap_bounds
from agent.experts.layout import CONFIG, EXPERTS, INDEX, Block, Index
from agent.experts.reader import IO_THREADS, MmapReader

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.common import count, machine, write_results  # noqa: E402

DEMO = ROOT / "data" / "loader-demo"


@dataclass
class Row:
    config: str
    mb_s: float               # bytes / seconds over all rounds, MB = 10^6 bytes
    raw_mb_s: float           # the same for the raw reads paired with this configuration's sweeps
    ratio: float              # mb_s / raw_mb_s
    rounds_mb_s: list[float]  # each round's rate
    rounds_raw_mb_s: list[float]


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
    gc.collect()  # the process's first model keeps its run's mmap in torch's first-import cycle until then
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
def raw_direct_read(path: Path, chunk_bytes: int, streams: int = 1, span: tuple[int, int] | None = None) -> float:
    """Seconds to read the file (or the byte range `span`) with O_DIRECT: `streams` threads, each
    reading a contiguous share in order into its own page-aligned buffer of chunk_bytes."""
    start, end = span or (0, path.stat().st_size)
    share = -(-(end - start) // streams // chunk_bytes) * chunk_bytes    # whole chunks, so offsets stay aligned
    bounds = [(start + i * share, min(end, start + (i + 1) * share)) for i in range(streams)]
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        began = time.perf_counter()
        with ThreadPoolExecutor(streams) as pool:
            done = sum(pool.map(lambda b: _read_range(fd, chunk_bytes, *b), bounds))
        elapsed = time.perf_counter() - began
    finally:
        os.close(fd)
    assert done == end - start, "raw read ended early"
    return elapsed


def _read_range(fd: int, chunk_bytes: int, offset: int, end: int) -> int:
    buf = mmap.mmap(-1, chunk_bytes)
    view = memoryview(buf)
    done = 0
    try:
        while offset + done < end and (n := os.preadv(fd, [view[:min(chunk_bytes, end - offset - done)]],
                                                      offset + done)):
            done += n
    finally:
        view.release()
        buf.close()
    return done


def raw_block_read(path: Path, index: Index, streams: int, seed: int = 0) -> float:
    """Seconds to read every expert block once with O_DIRECT, whole (its slot's extent), in a shuffled
    order with `streams` reads in flight: the cache's own pattern of misses, without the cache."""
    order = np.random.default_rng(seed).permutation(len(index.blocks))
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buffers = [mmap.mmap(-1, index.slot_bytes) for _ in range(streams)]
    free = queue.SimpleQueue()
    for buf in buffers:
        free.put(buf)

    def read(block: Block) -> int:
        buf = free.get()
        try:
            return os.preadv(fd, [buf], block.offset)
        finally:
            free.put(buf)
    try:
        began = time.perf_counter()
        with ThreadPoolExecutor(streams) as pool:
            done = list(pool.map(read, (index.blocks[i] for i in order)))
        elapsed = time.perf_counter() - began
    finally:
        os.close(fd)
        for buf in buffers:
            buf.close()
    assert all(n >= index.nbytes for n in done), "a raw block read ended early"
    return elapsed


def best_raw_read(path: Path, chunk_bytes: int, streams: int) -> tuple[float, int]:
    """(seconds, streams) of the faster of one stream and `streams` concurrent ones over the whole file."""
    return min((raw_direct_read(path, chunk_bytes, n), n) for n in dict.fromkeys((1, streams)))


def raw_baseline(path: Path, index: Index, chunk_bytes: int, streams: int) -> dict[str, float]:
    """The device's raw O_DIRECT bandwidth, MB/s, read both ways: the file in order (the faster of one stream
    and `streams`) and as the cache reads (every block whole, shuffled, `streams` in flight); raw_mb_s is
    the faster, the baseline a run's reads are measured against."""
    raw_s, n = best_raw_read(path, chunk_bytes, streams)
    blocks_s = raw_block_read(path, index, streams)
    file_mb_s, blocks_mb_s = path.stat().st_size / raw_s / 1e6, index.nbytes * len(index.blocks) / blocks_s / 1e6
    return {"raw_mb_s": max(file_mb_s, blocks_mb_s), "raw_file_mb_s": file_mb_s, "raw_streams": n,
            "raw_blocks_mb_s": blocks_mb_s}


def host_cache_check(path: Path, chunk_bytes: int, nbytes: int = 256 * 2**20) -> tuple[float, float]:
    """MB/s of two O_DIRECT reads of the same region in a row: a much faster second read means the
    (virtual) device's host serves repeated reads from its own RAM."""
    size = path.stat().st_size
    start = (size // 2) // chunk_bytes * chunk_bytes
    span = (start, min(size, start + nbytes))
    return tuple((span[1] - span[0]) / raw_direct_read(path, chunk_bytes, 1, span) / 1e6 for _ in range(2))


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
    size = (store / EXPERTS).stat().st_size
    configs = {"raw O_DIRECT, 1 stream": (lambda: raw_direct_read(store / EXPERTS, chunk_bytes), size),
               f"raw O_DIRECT, {io_threads} streams":
                   (lambda: raw_direct_read(store / EXPERTS, chunk_bytes, io_threads), size)}
    for backend, verify, shuffled in [("direct", True, False), ("direct", False, False), ("direct", True, True),
                                      ("buffered", True, False), ("mmap", True, False), ("mmap", True, True)]:
        name = f"cache {backend}, crc {'on' if verify else 'off'}, {'shuffled' if shuffled else 'sequential'}"
        configs[name] = (lambda b=backend, v=verify, s=shuffled: cache_sweep(store, b, v, s, io_threads), payload)
    return configs


def run(store: Path, repeat: int, chunk_bytes: int, io_threads: int) -> tuple[list[Row], list[int]]:
    """Each configuration is measured beside its own raw read (after it in even rounds, before it in odd
    ones), so a pair shares the machine's load. Returns the rows (the raw reads themselves first) and,
    per raw read, how many streams won."""
    configs = configurations(store, chunk_bytes, io_threads)
    raw_bytes = (store / EXPERTS).stat().st_size
    pairs: dict[str, list[tuple[int, float, float]]] = {name: [] for name in configs}  # (bytes, seconds, raw seconds)
    winners = []
    for round_ in range(repeat):
        for name, (measure, nbytes) in configs.items():
            sweep_first = round_ % 2 == 1
            seconds = measure() if sweep_first else 0.0
            raw_s, streams = best_raw_read(store / EXPERTS, chunk_bytes, io_threads)
            if not sweep_first:
                seconds = measure()
            winners.append(streams)
            pairs[name].append((nbytes, seconds, raw_s))
    return [_row(name, p, raw_bytes) for name, p in pairs.items()], winners


def _row(name: str, pairs: list[tuple[int, float, float]], raw_bytes: int) -> Row:
    mb_s = sum(b for b, _, _ in pairs) / sum(s for _, s, _ in pairs) / 1e6
    raw_mb_s = raw_bytes * len(pairs) / sum(r for _, _, r in pairs) / 1e6
    return Row(name, mb_s, raw_mb_s, mb_s / raw_mb_s, [round(b / s / 1e6, 1) for b, s, _ in pairs],
               [round(raw_bytes / r / 1e6, 1) for _, _, r in pairs])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="an expert store (default: the demo model in data/loader-demo)")
    parser.add_argument("--repeat", type=count, default=4,
                        help="interleaved rounds (even, so each order of sweep and raw read is used equally)")
    parser.add_argument("--chunk-mb", type=count, default=16, help="raw read chunk size in MiB")
    parser.add_argument("--io-threads", type=count, default=IO_THREADS, help=f"default {IO_THREADS}, as the agent")
    args = parser.parse_args()
    store = bench_store(args.model)
    index = Index.load(store / INDEX)
    facts = machine(store)
    chunk = args.chunk_mb * 2**20
    first, second = host_cache_check(store / EXPERTS, chunk)
    rows, winners = run(store, args.repeat, chunk, args.io_threads)
    print(f"\nstore {store}: {len(index.blocks)} blocks of {index.nbytes / 2**20:.2f} MiB, "
          f"{(store / EXPERTS).stat().st_size / 2**30:.2f} GiB; raw chunk {args.chunk_mb} MiB; "
          f"{args.io_threads} io threads; {args.repeat} rounds")
    print(f"machine: {facts['cpu']}, {facts['cores']} cores, {facts['ram_bytes'] / 2**30:.1f} GiB RAM, "
          f"{facts['filesystem']}, kernel {facts['kernel']}, DIO alignment {facts['dio_alignment']}, "
          f"load {facts['load_avg'][0]:.1f}\n")
    width = max(len(r.config) for r in rows)
    print(f"{'configuration':<{width}}  {'MB/s':>8}  {'raw MB/s':>9}  {'x raw':>6}  {'rounds MB/s':>13}")
    for r in rows:
        spread = f"{min(r.rounds_mb_s):.0f}-{max(r.rounds_mb_s):.0f}"
        print(f"{r.config:<{width}}  {r.mb_s:>8.0f}  {r.raw_mb_s:>9.0f}  {r.ratio:>6.2f}  {spread:>13}")
    print(f"\nraw = the faster of 1 and {args.io_threads} O_DIRECT streams, read before each sweep in even rounds "
          f"and after it in odd ones ({winners.count(1)} of {len(winners)} won by 1 stream).")
    print(f"host cache: one 256 MiB region read twice with O_DIRECT: {first:.0f} then {second:.0f} MB/s"
          f"{' (the host serves repeated reads from its RAM)' if second > 1.5 * first else ''}.")
    print("direct bypasses the page cache; buffered and mmap start cold (posix_fadvise DONTNEED before each sweep).")
    print()
    write_results("loader", {"command": " ".join(sys.argv), "store": str(store), "blocks": len(index.blocks),
                             "block_bytes": index.nbytes, "file_bytes": (store / EXPERTS).stat().st_size,
                             "repeat": args.repeat, "chunk_bytes": chunk, "io_threads": args.io_threads,
                             "raw_streams_won": winners, "host_cache_mb_s": [first, second],
                             "machine": facts, "rows": [asdict(r) for r in rows]})


if __name__ == "__main__":
    main()

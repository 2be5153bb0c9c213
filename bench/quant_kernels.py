"""How to compute with int8 and int4 experts on this CPU: each choice against the bf16 expert, by tokens per expert.

    .venv/bin/python bench/quant_kernels.py [--tokens 1,2,4,...,512] [--threads 1,2] [--chunk 64] [--repeats 7]
                                            [--store DIR] [--results quant_kernels]

One routed expert's SwiGLU (gate|up [2I, H], down [H, I]) of OLMoE-1B-7B (H 2048, I 1024) and
Qwen3-30B-A3B (H 2048, I 768) with random weights, with each of --threads torch threads (the serving
engine runs one):
- bf16: the expert as stored today (F.linear on bf16 weights);
- int8 kernel: torch's `_weight_int8pack_mm` (x @ (q * scale).T, scale per output channel);
- int8 converted: q converted to bf16 for the matmul, output channels scaled after;
- int8 W8A8: the activations quantized too (per token, symmetric) for torch's int8 x int8 matmul
  (`_int_mm`, int32 sums), then scaled per token and output channel (agent/experts/quant.py
  linear_int8_w8a8, which the runtime takes above INT8_KERNEL_MAX_TOKENS; its time includes quantizing
  the activations and scaling the sums), which adds the activations' rounding error;
- int4 kernel: torch's `_weight_int4pack_mm_for_cpu` on the store's int4 block (agent/experts/quant.py,
  a scale and zero per 64 weights along a row);
- int4 kernel chunked: the same kernel called on chunks of at most --chunk tokens;
- int4 dequantized: the int4 matrices dequantized to bf16 for each matmul (agent/experts/quant.py
  dequantize_int4; its time alone, both matrices, is printed below the table);
- dequantize on load: what a miss would pay once to turn an int8 block into bf16 in its slot (then the
  bf16 column applies); with --store, beside the read time that halving the block saves at the raw
  O_DIRECT rate of that store's experts.bin (the faster of one stream and the cache's I/O threads),
  measured in the same run.
Times are, with one thread, CPU time of the calling thread (the machine is shared: others' bursts
inflate wall time, not the work done), and with more, wall time (the calling thread's CPU time leaves
out the others'); the minimum over `--repeats` rounds of the mean over a batch of calls (fewer calls
above 16 tokens, at least 2); the configurations run interleaved. JSON: bench/results/<--results>.json.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from agent.experts.layout import EXPERTS
from agent.experts.provider import ExpertWeights
from agent.experts.reader import IO_THREADS
from agent.experts.quant import (INT4_GROUP, Int4Expert, Int8Expert, dequantize_int4, linear_int8_converted,
                                 linear_int8_kernel, linear_int8_w8a8, pack_int4, quantize_groups, quantize_rows)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))   # the repo, so `bench` imports when run as a script
from bench.common import count, counts, machine, results_name, write_results  # noqa: E402
from bench.loader import best_raw_read  # noqa: E402

SHAPES = {"OLMoE-1B-7B": (2048, 1024), "Qwen3-30B-A3B": (2048, 768)}  # hidden, expert intermediate
CALLS_PER_ROUND = 20
CHOICES = ("int8 kernel", "int8 converted", "int8 W8A8", "int4 kernel", "int4 kernel chunked",
           "int4 dequantized")  # beside bf16


def cpu_ms(fn: Callable[[], object], repeats: int, calls: int = CALLS_PER_ROUND) -> float:
    """ms per call of `fn`: thread CPU time with one torch thread, wall time with more (see above)."""
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        for _ in range(calls):
            fn()
        best = min(best, (clock() - start) / calls)
    return best * 1e3


def experts(hidden: int, inter: int) -> tuple[ExpertWeights, Int8Expert, Int4Expert]:
    torch.manual_seed(0)
    gate, up = (torch.randn(inter, hidden, dtype=torch.bfloat16) * 0.02 for _ in range(2))
    down = torch.randn(hidden, inter, dtype=torch.bfloat16) * 0.02
    (q_gu, s_gu), (q_d, s_d) = quantize_rows(torch.cat([gate, up]), torch.bfloat16), quantize_rows(down, torch.bfloat16)
    (q4_gu, sz_gu), (q4_d, sz_d) = (quantize_groups(w, torch.bfloat16) for w in (torch.cat([gate, up]), down))
    int4 = Int4Expert(pack_int4(q4_gu), pack_int4(q4_d), sz_gu, sz_d, hidden, inter)
    return ExpertWeights(gate, up, down), Int8Expert(q_gu, q_d, s_gu, s_d), int4


def int4_dequantized(e: Int4Expert, x: torch.Tensor) -> torch.Tensor:
    """The int4 expert with both matrices dequantized to x's dtype for the matmuls (what linear_int4 does
    above INT4_KERNEL_MAX_TOKENS)."""
    gate, up = F.linear(x, dequantize_int4(e.gate_up, e.gate_up_sz, x.dtype)).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, dequantize_int4(e.down, e.down_sz, x.dtype))


def int4_kernel(e: Int4Expert, x: torch.Tensor) -> torch.Tensor:
    gate, up = torch.ops.aten._weight_int4pack_mm_for_cpu(x, e.gate_up, INT4_GROUP, e.gate_up_sz).chunk(2, dim=-1)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(F.silu(gate) * up, e.down, INT4_GROUP, e.down_sz)


def int4_kernel_chunked(e: Int4Expert, x: torch.Tensor, chunk: int) -> torch.Tensor:
    return torch.cat([int4_kernel(e, part) for part in x.split(chunk)])


def swiglu_with(linear: Callable, expert: Int8Expert, x: torch.Tensor) -> torch.Tensor:
    gate, up = linear(x, expert.gate_up, expert.gate_up_scale).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, expert.down, expert.down_scale)


def measure(hidden: int, inter: int, tokens: list[int], chunk: int, repeats: int) -> dict:
    plain, int8, int4 = experts(hidden, inter)
    rows = []
    for t in tokens:
        x = torch.randn(t, hidden, dtype=torch.bfloat16)
        calls = max(2, min(CALLS_PER_ROUND, CALLS_PER_ROUND * 16 // t))
        times = {}
        for _ in range(2):  # interleaved rounds; keep each configuration's best
            for name, fn in {"bf16": lambda: plain(x),
                             "int8 kernel": lambda: swiglu_with(linear_int8_kernel, int8, x),
                             "int8 converted": lambda: swiglu_with(linear_int8_converted, int8, x),
                             "int8 W8A8": lambda: swiglu_with(linear_int8_w8a8, int8, x),
                             "int4 kernel": lambda: int4_kernel(int4, x),
                             "int4 kernel chunked": lambda: int4_kernel_chunked(int4, x, chunk),
                             "int4 dequantized": lambda: int4_dequantized(int4, x)}.items():
                times[name] = min(times.get(name, float("inf")), cpu_ms(fn, repeats, calls))
        rows.append({"tokens": t, **{f"{k} ms": v for k, v in times.items()}})
    return {"hidden": hidden, "intermediate": inter, "rows": rows,
            "dequantize on load ms": cpu_ms(lambda: dequantize(int8), repeats, calls=3),
            "int4 dequantize ms": cpu_ms(lambda: (dequantize_int4(int4.gate_up, int4.gate_up_sz, torch.bfloat16),
                                                  dequantize_int4(int4.down, int4.down_sz, torch.bfloat16)), repeats),
            "bytes saved per miss": 3 * hidden * inter}  # int8 instead of bf16


def raw_rate(store: Path) -> float:
    """MB/s of O_DIRECT reads of the store's experts.bin at the device's best parallelism."""
    path = store / EXPERTS
    return path.stat().st_size / best_raw_read(path, 16 << 20, IO_THREADS)[0] / 1e6


def dequantize(e: Int8Expert) -> ExpertWeights:
    gate_up = e.gate_up.to(torch.bfloat16).mul_(e.gate_up_scale[:, None])
    return ExpertWeights(*gate_up.chunk(2), e.down.to(torch.bfloat16).mul_(e.down_scale[:, None]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=counts, default=[1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512],
                        help="tokens per expert to measure, comma-separated")
    parser.add_argument("--threads", type=counts, default=[1, 2],
                        help="torch thread counts to measure, comma-separated")
    parser.add_argument("--chunk", type=count, default=64, help="most tokens per call of the chunked int4 kernel")
    parser.add_argument("--repeats", type=count, default=7)
    parser.add_argument("--store", type=Path, help="an expert store whose experts.bin gives the raw O_DIRECT rate")
    parser.add_argument("--results", type=results_name, default="quant_kernels",
                        help="name of the JSON in bench/results/")
    args = parser.parse_args(argv)
    raw_mb_s = raw_rate(args.store) if args.store else None
    runs = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        runs[threads] = {name: measure(h, i, args.tokens, args.chunk, args.repeats) for name, (h, i) in SHAPES.items()}
        print_run(runs[threads], threads, args.chunk, raw_mb_s)
    write_results(args.results, {"threads": runs, "chunk": args.chunk, "raw_mb_s": raw_mb_s,
                                 "clock": "thread CPU time with one thread, wall time with more",
                                 "machine": machine(args.store)})
    return 0


def print_run(results: dict, threads: int, chunk: int, raw_mb_s: float | None) -> None:
    clock = "CPU ms of the calling thread" if threads == 1 else "wall ms"
    for name, r in results.items():
        print(f"\n{name} expert (hidden {r['hidden']}, intermediate {r['intermediate']}), {clock} per call, "
              f"{threads} torch thread(s), int4 kernel chunked at {chunk} tokens")
        print("| tokens | bf16 | " + " | ".join(f"{n} | × bf16" for n in CHOICES) + " |")
        print("|---|---|" + "---|---|" * len(CHOICES))
        for row in r["rows"]:
            b = row["bf16 ms"]
            print(f"| {row['tokens']} | {b:.3f} | " + " | ".join(f"{row[f'{n} ms']:.3f} | {row[f'{n} ms'] / b:.2f}"
                                                              for n in CHOICES) + " |")
        saved = (f", against {r['bytes saved per miss'] / raw_mb_s / 1e3:.2f} ms of reading saved at the raw "
                 f"{raw_mb_s:.0f} MB/s" if raw_mb_s else "")
        print(f"dequantize on load: {r['dequantize on load ms']:.2f} ms per block{saved}; "
              f"int4 dequantize (both matrices): {r['int4 dequantize ms']:.2f} ms")


if __name__ == "__main__":
    sys.exit(main())

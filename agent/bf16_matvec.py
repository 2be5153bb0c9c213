"""One token through a bf16 linear layer, at the speed the memory allows.

A decode step multiplies each weight matrix by one row of activations, so it is a pass over the
weights: the matrix is read once and every byte is used for one multiply-add. torch 2.13's bf16
F.linear takes ~1.5 ms for an OLMoE expert's 12.6 MB on this CPU (~8.5 GB/s); the compiled loop here
widens each weight row to float32 in a small buffer that stays in L1 and dots it with x, at ~14 GB/s
(bench/scale.py measures both on one layer's top-8 experts). With more rows of x torch's blocked GEMM
reuses each weight it loads and is the faster one, so `linear` takes this loop only for one bf16 row.

Numerics as torch's: products accumulate in float32 and the result is rounded to bf16 once (the
order of the additions differs, so a result may differ from torch's in its last bf16 bit).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import numba
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from agent.workers import parts, split_workers

# A one-token matvec this large is split by rows over the step's workers (agent/workers.py); handing out
# parts costs ~20 us (an each() of no-ops). A dev check on two workers, speed split against whole: a 64-row
# router 0.3-0.5x, 1024 x 2048 0.7-1.4x, 2048 x 2048 1.0-1.1x, OLMoE's LM head (50304 x 2048) 1.3-1.6x.
SPLIT_MIN_BYTES = 4 * 2**20
# Parts per worker: a helper that wakes late (its core busy) leaves the rest to the model's thread, which
# then waits for one small part rather than for half the matrix.
PARTS_PER_WORKER = 4
T = TypeVar("T")


@numba.njit(cache=True, fastmath={"reassoc", "contract"}, nogil=True, boundscheck=False)
def _matvec(w: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """out[i] += sum_j w[i, j] * x[j]: w [R, C] the bf16 bit patterns (uint16), x [C] and out [R] float32.

    Reassociation lets LLVM split the sum over vector lanes (no fastmath flag assumes NaN or infinity
    away: they propagate as in torch); nogil lets the cache's I/O threads run."""
    rows, cols = w.shape
    bits = np.empty(cols, np.uint32)
    row = bits.view(np.float32)                   # a bf16 is the top half of a float32
    for i in range(rows):
        for j in range(cols):
            bits[j] = np.uint32(w[i, j]) << 16
        acc = np.float32(0.0)
        for j in range(cols):
            acc += row[j] * x[j]
        out[i] += acc


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear(x, weight, bias); one row of bf16 x [1, in] against a contiguous bf16 weight takes the loop."""
    recorded = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)   # autograd needs torch's op
    if recorded or not (x.dtype == weight.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] == 1
                        and weight.is_contiguous()):
        return F.linear(x, weight, bias)
    out = torch.zeros(weight.shape[0]) if bias is None else bias.to(torch.float32, copy=True)  # added before rounding
    w, x32, out32 = weight.detach().view(torch.uint16).numpy(), x[0].float().contiguous().numpy(), out.numpy()
    by_rows(w.shape[0], weight.nbytes, lambda rows: _matvec(w[rows], x32, out32[rows]))
    return out.to(torch.bfloat16).view(1, -1)


def by_rows(rows: int, nbytes: int, fn: Callable[[slice], T], min_bytes: int = SPLIT_MIN_BYTES) -> list[T]:
    """[fn(part) for each part of a one-token matvec's rows, in order]: split over the step's workers where
    its matrix of `nbytes` is at least `min_bytes`, else one part of all rows. Each row is computed as it
    would be whole, by whichever worker takes its part, so the result does not depend on the workers."""
    workers = split_workers() if nbytes >= min_bytes else None
    if workers is None:
        return [fn(slice(0, rows))]
    results: list[T] = [None] * PARTS_PER_WORKER * workers.workers   # type: ignore[list-item]
    chunks = list(enumerate(parts(rows, len(results))))

    def run(chunk: tuple[int, tuple[int, int]]) -> None:
        results[chunk[0]] = fn(slice(*chunk[1]))
    workers.each(chunks, run)
    return results[:len(chunks)]

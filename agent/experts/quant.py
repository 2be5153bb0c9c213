"""Quantized experts: how convert quantizes a block, and how the model computes with one straight from its slot.

int8:

Symmetric, one scale per output channel (row of an nn.Linear weight): w ~ q * scale, q in -127..127,
scale = max |w| of the row / 127, stored in the checkpoint's dtype (float32 for float16); q is rounded
against that stored scale, so the scale's own rounding costs nothing. Half the bytes of a bf16 block: each
miss reads half as much, and the same cache cap holds twice the experts.

Compute never dequantizes a whole block into RAM. A bf16 model with few tokens per expert (decode)
runs torch's int8-weight kernel (`_weight_int8pack_mm`: x @ (q * scale).T; for one token an expert
costs 0.4-0.5x the CPU time of the bf16 matvec on this CPU, bench/quant_kernels.py). With more than 8
(prefill, large batches), whose cost in the kernel grows with every token, it quantizes its activations
too (W8A8): per token, symmetric, x ~ xq * x_scale, for torch's int8 x int8 matmul with int32 sums,
scaled per token and output channel after; on this AVX-512 VNNI CPU an OLMoE expert then costs
0.6-0.9x the CPU time of bf16's matmul, where converting q for it cost 1.1-1.7x. That rounds the
activations as well as the weights (bench/quant_error.py measures what it adds); a model whose
activations hold outliers may be loaded without it (`activations=False`: generate and serve
--int8-activations off), and converts q instead. Another dtype, or a
width the kernel does not take, converts q to the model's dtype (float32 for float16) for the matmul
and scales its output channels after.

int4 (asymmetric, group-wise along a row, as torch's int4 kernel reads it): w ~ (q - 8) * scale + zero,
q in 0..15, one scale and one zero per group of INT4_GROUP weights, scale = (max - min) / 15 and zero =
min + 8 * scale of the group, both stored in the checkpoint's dtype (float32 for float16) and q rounded
against the stored pair. A matrix is padded with zero weights to whole INT4_ROWS-row blocks and groups
(the layout's int4_padded; OLMoE's and Qwen3's widths need none). 0.56 bytes a weight with the group's
pair: 0.56x an int8 block. q is packed as torch's `_weight_int4pack_mm_for_cpu` reads it on an AVX-512
CPU (pack_int4): the store holds that layout as is, so the kernel computes straight from the slot. A
bf16 model with few tokens per expert runs that kernel (as fast as the int8 one, bench/quant_kernels.py),
whose time grows with every token (it dequantizes its weights again for each few rows of x); more tokens,
another dtype, or a CPU whose kernel packs differently (AVX2 packs 32 rows, not 64) dequantize the matrix
to the model's dtype in one compiled pass (numba) for torch's matmul.
"""
from __future__ import annotations

from functools import cache
from typing import NamedTuple

import numba
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from agent.experts.layout import INT4_GROUP, INT4_ROWS, Index, Part, int4_padded

QMAX = 127
INT4_LEVELS = 15  # q in 0..INT4_LEVELS; the kernel subtracts INT4_MID
INT4_MID = 8
# bf16 x: torch's int8-weight kernel up to 8 tokens; above, int8 activations (W8A8: 0.86x the kernel's CPU time
# at 12 tokens, 0.6x converting q's from 16 on; bench/quant_kernels.py). At one token W8A8 takes 0.5x the
# kernel's time too, but it would change every decoded token's rounding: left to a measured decision
INT8_KERNEL_MAX_TOKENS = 8
INT4_KERNEL_MAX_TOKENS = 32  # above 32-48 tokens dequantizing and torch's matmul win (bench/quant_kernels.py)
# torch 2.13's kernel reads whole 16-wide vectors along K: other widths give garbage or a segfault here.
INT8_KERNEL_K_MULTIPLE = 16
_WIDE = {torch.float16: torch.float32}  # x @ q.T, before scaling, can pass float16's largest value


class QuantError(ValueError):
    """A tensor cannot be quantized (it holds NaN or infinity)."""


def quantize_rows(w: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(q int8 [out, in], scale [out] in `dtype`) with w ~ q * scale[:, None]."""
    w32 = _finite(w)
    scale = (w32.abs().amax(dim=1) / QMAX).to(dtype)
    q = _steps(w32, scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def quantize_groups(w: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(q uint8 [N, K] in 0..15, sz [K / INT4_GROUP, N, 2] in `dtype`: scale, zero) with w ~ (q - 8) *
    scale + zero per group, w [n, k] padded with zero weights to [N, K] = int4_padded(n, k)."""
    rows, columns = int4_padded(*w.shape)
    w32 = F.pad(_finite(w), (0, columns - w.shape[1], 0, rows - w.shape[0])).view(rows, -1, INT4_GROUP)
    low, high = w32.amin(-1), w32.amax(-1)
    scale = ((high - low) / INT4_LEVELS).to(dtype)
    zero = (low + INT4_MID * scale.float()).to(dtype)
    q = _steps(w32 - zero.float()[..., None], scale[..., None]).add_(INT4_MID).clamp_(0, INT4_LEVELS)
    return q.to(torch.uint8).view(rows, columns), torch.stack([scale, zero], -1).transpose(0, 1).contiguous()


def _finite(w: Tensor) -> Tensor:
    w32 = w.float()
    if not torch.isfinite(w32).all():
        raise QuantError("it holds NaN or infinite values")
    return w32


def _steps(w32: Tensor, scale: Tensor) -> Tensor:
    """w32 / scale rounded, against the scale as stored, so its own rounding costs nothing; where the
    scale is zero (an all-zero row or group, or a scale that underflows) the weights stay zero."""
    stored = scale.float()
    return torch.round(w32 / torch.where(stored > 0, stored, 1.0))


def pack_int4(q: Tensor) -> Tensor:
    """q uint8 [N, K] (0..15, N a multiple of INT4_ROWS) -> [N, K / 2] as torch's int4 kernel reads it on
    AVX-512: per block of INT4_ROWS rows, for each column k, byte n holds row n (low nibble) and row
    n + INT4_ROWS / 2 (high nibble)."""
    rows, columns = q.shape
    halves = q.view(rows // INT4_ROWS, 2, INT4_ROWS // 2, columns)
    return (halves[:, 0] | (halves[:, 1] << 4)).transpose(1, 2).contiguous().view(rows, columns // 2)


def quantize_block(weights: dict[str, Tensor], index: Index, payload: memoryview) -> None:
    """Write a block of `index`'s layout (int8 or int4) into `payload`, from gate, up and down in the model's dtype."""
    out = torch.frombuffer(payload, dtype=torch.uint8)
    dtype = getattr(torch, index.scale_dtype)
    parts = {p.name: p for p in index.parts}
    if index.quant == "int4":
        for name, w in (("gate_up", torch.cat([weights["gate"], weights["up"]])), ("down", weights["down"])):
            q, sz = quantize_groups(w, dtype)
            parts[name].view(out).copy_(pack_int4(q))
            parts[f"{name}_sz"].view(out).copy_(sz)
        return
    for name, w in weights.items():
        q, scale = quantize_rows(w, dtype)
        parts[name].view(out).copy_(q)
        parts[f"{name}_scale"].view(out).copy_(scale)


class Int8Expert(NamedTuple):
    """One routed expert's SwiGLU with int8 weights, viewed in its block (no copy)."""
    gate_up: Tensor         # [2I, H] int8: gate rows, then up rows (contiguous in the block)
    down: Tensor            # [H, I] int8
    gate_up_scale: Tensor   # [2I]
    down_scale: Tensor      # [H]
    activations: bool = True  # quantize bf16 activations above INT8_KERNEL_MAX_TOKENS (W8A8)

    @classmethod
    def view(cls, buf: Tensor, index: Index, activations: bool = True) -> "Int8Expert":
        """The expert in a block's bytes (a uint8 tensor of at least index.nbytes)."""
        p = {part.name: part for part in index.parts}
        return cls(_joined(buf, p["gate"], p["up"]).view(2 * index.intermediate, index.hidden), p["down"].view(buf),
                   _joined(buf, p["gate_scale"], p["up_scale"]), p["down_scale"].view(buf), activations)

    def __call__(self, x: Tensor) -> Tensor:
        """x [t, H] -> [t, H]"""
        gate, up = linear_int8(x, self.gate_up, self.gate_up_scale, self.activations).chunk(2, dim=-1)
        return linear_int8(F.silu(gate) * up, self.down, self.down_scale, self.activations)


def linear_int8(x: Tensor, q: Tensor, scale: Tensor, activations: bool = True) -> Tensor:
    """x [t, in] @ (q * scale[:, None]).T -> [t, out], by whichever way is faster for x; `activations`:
    whether bf16 x may be quantized too (W8A8) where it has more tokens than the kernel takes."""
    if x.dtype != torch.bfloat16:
        return linear_int8_converted(x, q, scale)
    if x.shape[0] <= INT8_KERNEL_MAX_TOKENS and q.shape[1] % INT8_KERNEL_K_MULTIPLE == 0:
        return linear_int8_kernel(x, q, scale)
    if activations and x.shape[0] > INT8_KERNEL_MAX_TOKENS:
        return linear_int8_w8a8(x, q, scale)
    return linear_int8_converted(x, q, scale)


def linear_int8_w8a8(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """x quantized too, per token (symmetric: x ~ xq * x_scale[:, None], xq in -127..127), for torch's int8 x
    int8 matmul with int32 sums on q's transposed view (copying q costs more than the matmul), then scaled
    per token and per output channel. A zero row keeps scale 0 and gives zeros; a row holding NaN or
    infinity gets a non-finite scale, so its outputs are non-finite as the float paths' are. In place
    where it can be: a new tensor of this size is fresh pages from the OS, each a page fault."""
    x_scale = x.abs().amax(dim=1, keepdim=True).float() / QMAX  # [t, 1]
    xq = x.float().div_(torch.where(x_scale > 0, x_scale, 1.0)).round_().to(torch.int8)
    return torch._int_mm(xq, q.T).float().mul_(x_scale).mul_(scale).to(x.dtype)


def linear_int8_kernel(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """torch's int8-weight kernel: bf16 x and scale, in-features a multiple of INT8_KERNEL_K_MULTIPLE."""
    return torch._weight_int8pack_mm(x, q, scale)


def linear_int8_converted(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """q converted to x's dtype (float32 for float16) for the matmul, output channels scaled after."""
    dtype = _WIDE.get(x.dtype, x.dtype)
    return (F.linear(x.to(dtype), q.to(dtype)) * scale.to(dtype)).to(x.dtype)


class Int4Expert(NamedTuple):
    """One routed expert's SwiGLU with int4 weights, viewed in its block (no copy)."""
    gate_up: Tensor     # [2I, H / 2] uint8, packed (pack_int4; I, H padded as int4_padded says)
    down: Tensor        # [H, I / 2] uint8, packed
    gate_up_sz: Tensor  # [H / INT4_GROUP, 2I, 2]: scale, zero
    down_sz: Tensor     # [I / INT4_GROUP, H, 2]
    hidden: int         # unpadded
    intermediate: int

    @classmethod
    def view(cls, buf: Tensor, index: Index) -> "Int4Expert":
        """The expert in a block's bytes (a uint8 tensor of at least index.nbytes)."""
        p = {part.name: part.view(buf) for part in index.parts}
        return cls(p["gate_up"], p["down"], p["gate_up_sz"], p["down_sz"], index.hidden, index.intermediate)

    def __call__(self, x: Tensor) -> Tensor:
        """x [t, H] -> [t, H]"""
        i = self.intermediate
        gate_up = linear_int4(x, self.gate_up, self.gate_up_sz)
        return linear_int4(F.silu(gate_up[:, :i]) * gate_up[:, i:2 * i], self.down, self.down_sz)[:, :self.hidden]


def linear_int4(x: Tensor, packed: Tensor, sz: Tensor) -> Tensor:
    """x [t, k] @ w.T -> [t, N] (padding rows included), w [N, K >= k] the dequantized int4 matrix; by
    whichever way is faster for x."""
    x = F.pad(x, (0, 2 * packed.shape[1] - x.shape[1]))
    if x.dtype == torch.bfloat16 and x.shape[0] <= INT4_KERNEL_MAX_TOKENS and int4_kernel_reads_store():
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, INT4_GROUP, sz)
    dtype = _WIDE.get(x.dtype, x.dtype)
    return F.linear(x.to(dtype), dequantize_int4(packed, sz, dtype)).to(x.dtype)


def dequantize_int4(packed: Tensor, sz: Tensor, dtype: torch.dtype) -> Tensor:
    """The int4 matrix w [N, K] in `dtype` (bfloat16 or float32): (q - 8) * scale + zero in float32, rounded
    once, as the transposed view of a contiguous [K, N] tensor (F.linear reads either): pack_int4's blocks
    hold each column's rows in runs of INT4_ROWS / 2, so w.T is written in runs, w in single weights."""
    rows, half = packed.shape
    scale, zero = sz.float().permute(2, 0, 1).contiguous()  # [K / INT4_GROUP, N] each
    wt = torch.empty(2 * half, rows, dtype=dtype)
    _dequantize_int4(packed.view(rows // INT4_ROWS, 2 * half, INT4_ROWS // 2).numpy(), scale.numpy(), zero.numpy(),
                     wt.view(_BITS[dtype]).numpy())
    return wt.T


_BITS = {torch.bfloat16: torch.uint16, torch.float32: torch.uint32}  # what the compiled loop writes


def warm_dequantize(index: Index) -> None:
    """Compile the dequantize pass an int4 store's model calls (or load it from numba's cache), on a
    matrix of one block and one group: ~6 s compiling, ~0.5 s from the cache on this machine, which the
    first step with more than INT4_KERNEL_MAX_TOKENS tokens an expert paid inside a request's latency."""
    if index.quant != "int4":
        return
    dtype = getattr(torch, index.dtype)
    q = torch.full((INT4_ROWS, INT4_GROUP), INT4_MID, dtype=torch.uint8)
    dequantize_int4(pack_int4(q), torch.zeros(1, INT4_ROWS, 2), _WIDE.get(dtype, dtype))


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _dequantize_int4(packed: np.ndarray, scale: np.ndarray, zero: np.ndarray, out: np.ndarray) -> None:
    """out [K, N] = w.T, one pass: packed uint8 [N / INT4_ROWS, K, INT4_ROWS / 2] (pack_int4's blocks),
    scale and zero float32 [K / INT4_GROUP, N]; out holds float32 bit patterns (uint32) or bf16 ones
    (uint16: the float32 rounded to nearest even, as torch rounds). A row of out is computed in float32
    in a buffer that stays in L1, then stored; nogil lets the cache's I/O threads run meanwhile."""
    blocks, columns, run = packed.shape
    row = np.empty(out.shape[1], np.float32)
    bits = row.view(np.uint32)
    for k in range(columns):
        g = k // INT4_GROUP
        for b in range(blocks):
            low = b * 2 * run  # rows b * INT4_ROWS + n in the low nibbles, + run in the high ones
            for n in range(run):
                byte = packed[b, k, n]
                row[low + n] = np.float32(np.int32(byte & 15) - INT4_MID) * scale[g, low + n] + zero[g, low + n]
                high = low + run + n
                row[high] = np.float32(np.int32(byte >> 4) - INT4_MID) * scale[g, high] + zero[g, high]
        if out.itemsize == 2:
            for j in range(row.size):
                out[k, j] = (bits[j] + np.uint32(0x7FFF) + ((bits[j] >> 16) & np.uint32(1))) >> 16
        else:
            out[k] = bits


def quantizes_activations(index: Index) -> bool:
    """Whether this store's experts may quantize their activations (linear_int8's W8A8): int8 blocks of a
    bf16 model."""
    return index.quant == "int8" and index.dtype == "bfloat16"


def slow_path(index: Index) -> str | None:
    """Why this store's experts would take the dequantized path at every token, if they would: int4
    blocks the int4 kernel cannot compute here (bench/quant_kernels.py: ~3.9 ms an OLMoE expert at one
    token, against the kernel's ~0.35 ms), so a user can convert with int8 instead."""
    if index.quant != "int4":
        return None
    if index.dtype != "bfloat16":
        return f"int4 experts of a {index.dtype} model are dequantized at every use (the int4 kernel takes bfloat16)"
    if not int4_kernel_reads_store():
        return ("this CPU's torch int4 kernel reads another packing than the store's (AVX-512's), so int4 "
                "experts are dequantized at every use")
    return None


@cache
def int4_kernel_reads_store() -> bool:
    """Whether this torch has the int4 kernel and packs as the store does (it packs 64 rows together on
    AVX-512, 32 on AVX2); asked once, by packing a test matrix both ways."""
    q = torch.randint(0, INT4_LEVELS + 1, (INT4_ROWS, 2 * INT4_GROUP), generator=torch.Generator().manual_seed(0))
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    except (AttributeError, RuntimeError):
        return False
    return torch.equal(packed, pack_int4(q.to(torch.uint8)))


def _joined(buf: Tensor, first: Part, second: Part) -> Tensor:
    """Two adjacent parts of one dtype as one flat tensor."""
    return buf[first.offset:second.offset + second.nbytes].view(getattr(torch, first.dtype))

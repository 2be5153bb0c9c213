"""int8 experts: how convert quantizes a block, and how the model computes with one straight from its slot.

Symmetric, one scale per output channel (row of an nn.Linear weight): w ~ q * scale, q in -127..127,
scale = max |w| of the row / 127, stored in the checkpoint's dtype (float32 for float16); q is rounded
against that stored scale, so the scale's own rounding costs nothing. Half the bytes of a bf16 block: each
miss reads half as much, and the same cache cap holds twice the experts.

Compute never dequantizes a whole block into RAM. A bf16 model with few tokens per expert (decode)
runs torch's int8-weight kernel (`_weight_int8pack_mm`: x @ (q * scale).T; for one token an expert
costs 0.4-0.5x the CPU time of the bf16 matvec on this CPU, bench/quant_kernels.py); more tokens, or
another dtype, convert q to the model's dtype (float32 for float16) for the matmul and scale its output
channels after. Above ~12 tokens per expert that costs 1.0-1.6x bf16: prefill and large batches
compute slower than with bf16 blocks.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from agent.experts.layout import Index, Part

QMAX = 127
INT8_KERNEL_MAX_TOKENS = 12  # above ~12-16 tokens the kernel is slower than converting q (bench/quant_kernels.py)
# torch 2.13's kernel reads whole 16-wide vectors along K: other widths give garbage or a segfault here.
INT8_KERNEL_K_MULTIPLE = 16
_WIDE = {torch.float16: torch.float32}  # x @ q.T, before scaling, can pass float16's largest value


class QuantError(ValueError):
    """A tensor cannot be quantized (it holds NaN or infinity)."""


def quantize_rows(w: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(q int8 [out, in], scale [out] in `dtype`) with w ~ q * scale[:, None]."""
    w32 = w.float()
    if not torch.isfinite(w32).all():
        raise QuantError("it holds NaN or infinite values")
    scale = (w32.abs().amax(dim=1) / QMAX).to(dtype)
    stored = scale.float()
    divisor = torch.where(stored > 0, stored, 1.0)  # an all-zero row (or one whose scale underflows) stays zero
    q = torch.round(w32 / divisor[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def quantize_block(weights: dict[str, Tensor], index: Index, payload: memoryview) -> None:
    """Write an int8 block of `index`'s layout into `payload`, from gate, up and down in the model's dtype."""
    out = torch.frombuffer(payload, dtype=torch.uint8)
    dtype = getattr(torch, index.scale_dtype)
    parts = {p.name: p for p in index.parts}
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

    @classmethod
    def view(cls, buf: Tensor, index: Index) -> "Int8Expert":
        """The expert in a block's bytes (a uint8 tensor of at least index.nbytes)."""
        p = {part.name: part for part in index.parts}
        return cls(_joined(buf, p["gate"], p["up"]).view(2 * index.intermediate, index.hidden), p["down"].view(buf),
                   _joined(buf, p["gate_scale"], p["up_scale"]), p["down_scale"].view(buf))

    def __call__(self, x: Tensor) -> Tensor:
        """x [t, H] -> [t, H]"""
        gate, up = linear_int8(x, self.gate_up, self.gate_up_scale).chunk(2, dim=-1)
        return linear_int8(F.silu(gate) * up, self.down, self.down_scale)


def linear_int8(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """x [t, in] @ (q * scale[:, None]).T -> [t, out], by whichever way is faster for x."""
    if x.dtype == torch.bfloat16 and x.shape[0] <= INT8_KERNEL_MAX_TOKENS and q.shape[1] % INT8_KERNEL_K_MULTIPLE == 0:
        return linear_int8_kernel(x, q, scale)
    return linear_int8_converted(x, q, scale)


def linear_int8_kernel(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """torch's int8-weight kernel: bf16 x and scale, in-features a multiple of INT8_KERNEL_K_MULTIPLE."""
    return torch._weight_int8pack_mm(x, q, scale)


def linear_int8_converted(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """q converted to x's dtype (float32 for float16) for the matmul, output channels scaled after."""
    dtype = _WIDE.get(x.dtype, x.dtype)
    return (F.linear(x.to(dtype), q.to(dtype)) * scale.to(dtype)).to(x.dtype)


def _joined(buf: Tensor, first: Part, second: Part) -> Tensor:
    """Two adjacent parts of one dtype as one flat tensor."""
    return buf[first.offset:second.offset + second.nbytes].view(getattr(torch, first.dtype))

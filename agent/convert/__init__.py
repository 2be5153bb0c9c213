"""flashmoe-cli convert: a Hugging Face MoE checkpoint -> the expert store of agent/experts/layout.py.

Accepts OLMoE, Qwen3-MoE, Qwen2-MoE and Mixtral checkpoints (config.json plus model.safetensors, or
shards listed in model.safetensors.index.json) with routed experts either per expert
(`model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`, Mixtral
`block_sparse_moe.experts.E.{w1,w3,w2}.weight`) or fused as transformers v5 holds them in memory
(`model.layers.N.mlp.experts.gate_up_proj` [E, 2I, H], gate rows first, and `.down_proj` [E, H, I]).

Routed experts of a bf16 checkpoint are stored as int8 by default (`--quantize auto`, see convert()).
Every other tensor goes to dense.safetensors byte for byte under the name transformers 5.24's
save_pretrained gives it (a fused Mixtral router `mlp.gate` becomes `block_sparse_moe.gate`).

The whole checkpoint is validated from the safetensors headers before anything is written. Tensors
are read with pread straight into one reused block buffer (no mmap, whose touched pages would count
as resident), so peak memory is one block plus a copy chunk whatever the model size. Output goes to
a temporary directory beside DST, the index is written last, and the directory is renamed into
place only when complete.

The parts, in the order convert uses them: checkpoint.py reads and checks the checkpoint into a
Plan, store_writer.py writes the store, safetensors_io.py reads and writes safetensors files and
errors.py holds CheckpointError. This module runs them and holds the CLI.
"""
from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path

import torch

from agent.convert.checkpoint import plan
from agent.convert.errors import CheckpointError
from agent.convert.safetensors_io import Span, payload_bytes
from agent.convert.store_writer import (StoreShape, StoreWriter, check_outside_models, check_replaceable, filled_up,
                                        followed)
from agent.experts.layout import QUANTS, Index
from agent.experts.quant import INT8_KERNEL_K_MULTIPLE, QuantError, quantize_block

log = logging.getLogger(__name__)


Progress = Callable[[int, int], None]
AUTO = "auto"   # int8 where it was measured to win end to end (BENCHMARKS.md, "Quantized experts"), else as stored


def convert(src: Path, dst: Path, overwrite: bool = False, progress: Progress | None = None,
            quantize: str | None = AUTO) -> Index:
    """Convert the checkpoint in `src` into an expert store at `dst`; returns the store's index.

    `quantize="int8"` stores the experts as int8 with a scale per output channel, "int4" as int4 with a
    scale and zero per group of weights along a row (agent/experts/quant.py), None in the checkpoint's
    dtype, and "auto" (the default) int8 for bf16 experts the int8 kernel takes (widths multiples of
    INT8_KERNEL_K_MULTIPLE), as stored otherwise.
    Raises CheckpointError, before writing anything, if the checkpoint is unusable, `dst` holds or is inside
    `src` or is inside another model, or `dst` is a non-empty directory and `overwrite` is false (or is true
    and `dst` is no expert store).
    `progress(done, total)` is called after each block.
    """
    src, dst = Path(src).expanduser(), followed(Path(dst).expanduser(), "DST_DIR")
    if quantize not in (None, AUTO, *QUANTS):
        raise CheckpointError(f"cannot quantize to {quantize!r}; choose {AUTO!r}, one of {', '.join(QUANTS)} or None")
    p = plan(src)
    quantize = _chosen_quant(p.shape) if quantize == AUTO else quantize
    _check_destination(src, dst, overwrite)
    with _Readers() as readers, StoreWriter(dst, replace(p.shape, quant=quantize), replace=overwrite) as writer:
        writer.check_room(sum(file.stat().st_size for file in p.files) + payload_bytes(p.dense), "DST_DIR")
        for file in p.files:
            writer.copy_file(file, file.name)
        writer.write_dense(p.dense)
        fill = _Quantizer(readers, writer.index) if quantize else readers.read_into
        for done, spans in enumerate(p.blocks, 1):
            writer.add_block(lambda view, spans=spans: fill(view, spans))
            if progress:
                progress(done, len(p.blocks))
    return writer.index


def _chosen_quant(shape: StoreShape) -> str | None:
    """What "auto" stores: int8 for bf16 experts whose matmuls the int8 kernel runs (2.5x decode and half
    the serving P99 at seed scale, BENCHMARKS.md), the checkpoint's dtype for the others (no kernel)."""
    kernel_widths = shape.hidden % INT8_KERNEL_K_MULTIPLE == 0 and shape.intermediate % INT8_KERNEL_K_MULTIPLE == 0
    return "int8" if shape.dtype == "bfloat16" and kernel_widths else None


def _check_destination(src: Path, dst: Path, overwrite: bool) -> None:
    source, target = src.resolve(), dst.resolve()
    if target == source or target in source.parents:   # replacing dst would delete the checkpoint with it
        raise CheckpointError(f"the destination {dst} holds the checkpoint {src}; choose a directory outside it")
    if source in target.parents:
        raise CheckpointError(f"the destination {dst} is inside the checkpoint {src}; choose a directory outside it")
    check_outside_models(dst, "DST_DIR")
    if dst.exists() and not dst.is_dir():
        raise CheckpointError(f"the destination {dst} exists and is not a directory; choose another path")
    if dst.exists() and any(dst.iterdir()):
        if not overwrite:
            raise CheckpointError(f"the destination {dst} already exists and is not empty; choose another directory "
                                  f"or pass --overwrite to replace it")
        check_replaceable(dst, "--overwrite")


class _Readers:
    """One open descriptor per checkpoint file, read with pread straight into the block buffer."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}

    def read_into(self, view: memoryview, spans: Iterable[Span]) -> None:
        at = 0
        for span in spans:
            fd = self._fds.get(span.file)
            if fd is None:
                fd = self._fds[span.file] = os.open(span.file, os.O_RDONLY)
            if os.preadv(fd, [view[at:at + span.nbytes]], span.offset) != span.nbytes:
                raise CheckpointError(f"{span.file} ended early; was it modified during convert?")
            at += span.nbytes

    def __enter__(self) -> "_Readers":
        return self

    def __exit__(self, *exc) -> None:
        for fd in self._fds.values():
            os.close(fd)


class _Quantizer:
    """Fills a quantized block: reads gate | up | down in the checkpoint's dtype into a scratch buffer, quantizes."""

    def __init__(self, readers: _Readers, index: Index) -> None:
        self.readers, self.index = readers, index
        self.plain = replace(index, quant=None)  # the checkpoint's layout of a block
        self.raw = torch.empty(self.plain.nbytes, dtype=torch.uint8)

    def __call__(self, payload: memoryview, spans: Iterable[Span]) -> None:
        self.readers.read_into(memoryview(self.raw.numpy()), spans)
        weights = {part.name: part.view(self.raw) for part in self.plain.parts}
        try:
            quantize_block(weights, self.index, payload)
        except QuantError as exc:
            layer, expert = divmod(len(self.index.blocks), self.index.n_experts)
            raise CheckpointError(f"cannot quantize expert {expert} of MoE layer {layer}: {exc}; "
                                  f"convert with --quantize none") from None


# ---------------------------------------------------------------- CLI

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("example:\n  flashmoe-cli convert ~/models/OLMoE-1B-7B-0924 data/olmoe\n\n"
                     "SRC_DIR holds config.json and model.safetensors (or shards with "
                     "model.safetensors.index.json).")
    parser.add_argument("src", metavar="SRC_DIR", type=Path, help="Hugging Face checkpoint directory")
    parser.add_argument("dst", metavar="DST_DIR", type=Path, help="where to write the expert store")
    parser.add_argument("--overwrite", action="store_true", help="replace DST_DIR if it already holds an expert store")
    parser.add_argument("--quantize", choices=(AUTO, *QUANTS, "none"), default=AUTO,
                        help="int8: the experts as int8 with a scale per output channel, half the bytes of bf16 "
                        "per block (the model's answers change slightly); int4: 4 bits a weight with a scale and "
                        "zero per 64 weights, 0.28x the bytes of bf16 (the answers change more); none: in the "
                        "checkpoint's dtype; auto (default): int8 for bf16 experts, none for float32 and float16")


def run(args: argparse.Namespace) -> int:
    start = time.monotonic()
    try:
        index = convert(args.src, args.dst, overwrite=args.overwrite, progress=_log_progress,
                        quantize=None if args.quantize == "none" else args.quantize)
    except CheckpointError as exc:
        log.error("convert failed: %s", exc)
        return 1
    except OSError as exc:
        # a full disk (filled_up): something else took the room the start found
        log.error("convert failed: %s", filled_up(exc, args.dst, "DST_DIR")
                  or f"{exc}; nothing was written to {args.dst}")
        return 1
    log.info("wrote %s: %d layers x %d experts, %s blocks of %.2f MB (%.1f GB) in %.1f s", args.dst,
             index.n_layers, index.n_experts, index.quant or index.dtype, index.nbytes / 1e6,
             len(index.blocks) * index.slot_bytes / 1e9, time.monotonic() - start)
    return 0


def _log_progress(done: int, total: int) -> None:
    if done * 10 // total != (done - 1) * 10 // total:
        log.info("converted %d of %d expert blocks", done, total)

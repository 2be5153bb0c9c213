"""flashmoe-cli convert: a Hugging Face MoE checkpoint -> the expert store of agent/experts/layout.py.

Accepts OLMoE, Qwen3-MoE, Qwen2-MoE and Mixtral checkpoints (config.json plus model.safetensors, or
shards listed in model.safetensors.index.json) with routed experts either per expert
(`model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`, Mixtral
`block_sparse_moe.experts.E.{w1,w3,w2}.weight`) or fused as transformers v5 holds them in memory
(`model.layers.N.mlp.experts.gate_up_proj` [E, 2I, H], gate rows first, and `.down_proj` [E, H, I]).

Every other tensor goes to dense.safetensors byte for byte under the name transformers 5.24's
save_pretrained gives it (a fused Mixtral router `mlp.gate` becomes `block_sparse_moe.gate`).

The whole checkpoint is validated from the safetensors headers before anything is written. Tensors
are read with pread straight into one reused block buffer (no mmap, whose touched pages would count
as resident), so peak memory is one block plus a copy chunk whatever the model size. Output goes to
a temporary directory beside DST, the index is written last, and the directory is renamed into
place only when complete.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agent.experts.layout import ALIGN, CONFIG, DENSE, EXPERTS, INDEX, Block, Index, crc32, partial_prefix
from agent.model.config import ConfigError, MoEConfig

log = logging.getLogger(__name__)

TOKENIZER = "tokenizer.json"
SHARD_INDEX = "model.safetensors.index.json"
# safetensors dtype code -> (torch dtype name, itemsize); the float types experts come in.
DTYPES = {"F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2)}
_NUMPY_CODES = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}
_COPY_CHUNK = 8 << 20


class CheckpointError(Exception):
    """The input checkpoint (or the destination) is unusable; the message says what and what to do."""


# ---------------------------------------------------------------- safetensors, streamed both ways

@dataclass(frozen=True)
class Span:
    """A byte range of one file."""
    file: Path
    offset: int
    nbytes: int


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str             # safetensors code, e.g. "BF16"
    shape: tuple[int, ...]
    span: Span             # the tensor's data in its file


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file, from its header only; checks the file is long enough."""
    size = path.stat().st_size
    n, header = _raw_header(path, size)
    tensors = {}
    for name, meta in header.items():
        try:
            begin, end = meta["data_offsets"]
            info = TensorInfo(name, str(meta["dtype"]), tuple(int(d) for d in meta["shape"]),
                              Span(path, 8 + n + int(begin), int(end) - int(begin)))
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: the header entry of {name} is malformed; re-download the file") from None
        if info.span.offset + info.span.nbytes > size:
            raise CheckpointError(f"{path} is truncated: tensor {name} needs bytes up to "
                                  f"{info.span.offset + info.span.nbytes} but the file has {size}; re-download it")
        if info.dtype in DTYPES and math.prod(info.shape) * DTYPES[info.dtype][1] != info.span.nbytes:
            raise CheckpointError(f"{path}: tensor {name} has {info.span.nbytes} bytes, not what "
                                  f"shape {list(info.shape)} {info.dtype} needs; the file is corrupt")
        tensors[name] = info
    return tensors


def _raw_header(path: Path, size: int) -> tuple[int, dict]:
    """(header length, header without __metadata__) of a safetensors file: 8-byte length, then JSON."""
    with open(path, "rb") as f:
        raw = f.read(8)
        n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        if not 0 < n <= min(size - 8, 100 << 20):
            raise CheckpointError(f"{path} is not a safetensors file (bad header length); re-download it")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise CheckpointError(f"{path} has a corrupt safetensors header ({exc}); re-download it") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has a safetensors header that is not a JSON object; re-download it")
    header.pop("__metadata__", None)
    return n, header


DenseSource = TensorInfo | np.ndarray


def write_safetensors(path: Path, tensors: Sequence[tuple[str, DenseSource]]) -> None:
    """Write a safetensors file one tensor at a time: file-backed tensors are copied in chunks."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, src in tensors:
        dtype, shape, nbytes = _describe(src)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data section to 8 bytes
    with open(path, "wb") as out:
        out.write(len(raw).to_bytes(8, "little") + raw)
        for _, src in tensors:
            if isinstance(src, np.ndarray):
                out.write(np.ascontiguousarray(src).data)
            else:
                _copy_span(src.span, out)


def _describe(src: DenseSource) -> tuple[str, tuple[int, ...], int]:
    if isinstance(src, np.ndarray):
        return _NUMPY_CODES[src.dtype], src.shape, src.nbytes
    return src.dtype, src.shape, src.span.nbytes


def _copy_span(span: Span, out) -> None:
    with open(span.file, "rb", buffering=0) as f:
        done = 0
        while done < span.nbytes:
            chunk = os.pread(f.fileno(), min(_COPY_CHUNK, span.nbytes - done), span.offset + done)
            if not chunk:
                raise CheckpointError(f"{span.file} ended early while copying; was it modified during convert?")
            out.write(chunk)
            done += len(chunk)


# ---------------------------------------------------------------- the store writer

@dataclass(frozen=True)
class StoreShape:
    n_layers: int
    n_experts: int
    hidden: int
    intermediate: int
    dtype: str      # torch dtype name
    itemsize: int


class StoreWriter:
    """Writes one expert store into a temporary directory beside `dst`; renamed into place on success.

    Blocks must come in index order (layer-major). Used as a context manager: a clean exit commits
    (index written last, everything fsynced, then one rename), an exception deletes the partial
    directory. `replace` allows an existing `dst` to be swapped out.
    """

    def __init__(self, dst: Path, shape: StoreShape, replace: bool = False) -> None:
        self.dst = Path(dst)
        self.replace = replace
        self.index = Index(shape.n_layers, shape.n_experts, shape.hidden, shape.intermediate, shape.dtype,
                           shape.itemsize, alignment=ALIGN, blocks=[])
        self.dst.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_partials(self.dst)
        self.tmp = Path(tempfile.mkdtemp(prefix=partial_prefix(self.dst), dir=self.dst.parent))
        self._fd = os.open(self.tmp / EXPERTS, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._slot = bytearray(self.index.slot_bytes)  # the padding after the payload stays zero

    @property
    def n_blocks(self) -> int:
        return self.index.n_layers * self.index.n_experts

    def write_config(self, config: dict) -> None:
        self.write_text(CONFIG, json.dumps(config, indent=2) + "\n")

    def write_text(self, name: str, text: str) -> None:
        (self.tmp / name).write_text(text)

    def copy_file(self, src: Path, name: str) -> None:
        shutil.copyfile(src, self.tmp / name)

    def write_dense(self, tensors: Sequence[tuple[str, DenseSource]]) -> None:
        write_safetensors(self.tmp / DENSE, tensors)

    def add_block(self, fill: Callable[[memoryview], None]) -> Block:
        """Append the next (layer, expert) block; `fill` writes gate|up|down into the payload view."""
        i = len(self.index.blocks)
        if i >= self.n_blocks:
            raise ValueError(f"the store already has all {self.n_blocks} blocks")
        payload = memoryview(self._slot)[: self.index.nbytes]
        fill(payload)
        block = Block(i // self.index.n_experts, i % self.index.n_experts,
                      offset=i * self.index.slot_bytes, crc32=crc32(payload))
        os.write(self._fd, self._slot)
        self.index.blocks.append(block)
        return block

    def __enter__(self) -> "StoreWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self._commit()
        else:
            self._abort()

    def _commit(self) -> None:
        try:
            if len(self.index.blocks) != self.n_blocks:
                raise ValueError(f"only {len(self.index.blocks)} of {self.n_blocks} blocks were written")
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
            self.index.save(self.tmp / INDEX)  # last: a directory without it is not a store
            os.chmod(self.tmp, 0o755)  # mkdtemp made it private; a store is shared like any model directory
            _fsync_path(self.tmp / INDEX)
            _fsync_path(self.tmp)
            self._swap_into_place()
        except BaseException:
            self._abort()
            raise

    def _swap_into_place(self) -> None:
        old = None
        if self.dst.exists() and not (self.dst.is_dir() and not any(self.dst.iterdir())):  # rename replaces an empty dir
            if not self.replace:
                raise CheckpointError(f"{self.dst} appeared while writing; nothing was replaced")
            old = Path(tempfile.mkdtemp(prefix=f".{self.dst.name}.old-", dir=self.dst.parent))
            os.rename(self.dst, old / "store")
        os.rename(self.tmp, self.dst)
        _fsync_path(self.dst.parent)
        if old is not None:
            shutil.rmtree(old)

    def _abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        shutil.rmtree(self.tmp, ignore_errors=True)


def _remove_stale_partials(dst: Path) -> None:
    """A killed writer leaves its temporary directory behind; the next run of the same dst clears it."""
    for stale in dst.parent.glob(partial_prefix(dst) + "*"):
        log.warning("removing %s, left by an interrupted run", stale)
        shutil.rmtree(stale, ignore_errors=True)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- architectures

@dataclass(frozen=True)
class Arch:
    """How one architecture names its routed experts (shapes come from agent.model.config.MoEConfig)."""
    moe_modules: tuple[str, ...]         # names the MoE block has inside a decoder layer; [0] is the saved one
    projections: tuple[str, str, str]    # per-expert gate, up, down module names


_QWEN = ("gate_proj", "up_proj", "down_proj")
ARCHS = {"olmoe": Arch(("mlp",), _QWEN), "qwen3_moe": Arch(("mlp",), _QWEN), "qwen2_moe": Arch(("mlp",), _QWEN),
         "mixtral": Arch(("block_sparse_moe", "mlp"), ("w1", "w3", "w2"))}


@dataclass
class LayerTensors:
    per_expert: dict[tuple[int, int], TensorInfo]   # (expert, 0 gate | 1 up | 2 down) -> tensor
    fused: dict[str, TensorInfo]                    # "gate_up_proj" | "down_proj" -> tensor
    module: str                                     # the MoE module name this layer uses


@dataclass
class Plan:
    """Everything convert will write, checked against config.json; nothing has been written yet."""
    shape: StoreShape
    blocks: list[tuple[Span, Span, Span]]     # gate, up, down of each block, layer-major
    dense: list[tuple[str, TensorInfo]]       # output name, source tensor
    files: list[Path]                         # config.json and tokenizer.json if present


def plan(src: Path) -> Plan:
    """Read config.json and the safetensors headers of `src` and check that they agree."""
    src = Path(src)
    config = _read_config(src)
    arch = ARCHS[config.arch]
    moe_ids = config.moe_layer_ids  # store layer i holds decoder layer moe_ids[i]'s experts
    shape = StoreShape(len(moe_ids), config.n_experts, config.dim, config.expert_dim, dtype="", itemsize=0)
    layers, dense = _split(_read_tensors(src), arch, config, src)
    dtypes = set()
    blocks: list[tuple[Span, Span, Span]] = []
    for layer in moe_ids:
        spans, layer_dtypes = _layer_spans(layer, layers.pop(layer, None), arch, shape)
        blocks += spans
        dtypes |= layer_dtypes
    if layers:
        raise CheckpointError(f"{src}: layer(s) {sorted(layers)} have expert tensors but config.json makes them "
                              f"dense MLP layers (mlp_only_layers / decoder_sparse_step); the config disagrees "
                              f"with the checkpoint")
    if len(dtypes) != 1 or next(iter(dtypes)) not in DTYPES:
        raise CheckpointError(f"{src}: expert tensors have dtype(s) {sorted(dtypes)}; flashmoe needs one of "
                              f"{', '.join(DTYPES)} for all experts (quantized checkpoints are not supported)")
    _check_dense_shapes(dict(dense), config, arch)
    torch_dtype, itemsize = DTYPES[dtypes.pop()]
    shape = StoreShape(shape.n_layers, shape.n_experts, shape.hidden, shape.intermediate, torch_dtype, itemsize)
    files = [src / CONFIG] + ([src / TOKENIZER] if (src / TOKENIZER).exists() else [])
    return Plan(shape, blocks, [(_saved_name(n, arch), t) for n, t in dense], files)


def _read_config(src: Path) -> MoEConfig:
    path = src / CONFIG
    if not src.is_dir():
        raise CheckpointError(f"{src} is not a directory; pass the checkpoint directory that holds config.json")
    try:
        return MoEConfig.from_file(path)
    except ConfigError as exc:
        raise CheckpointError(f"{path}: {exc}") from None


def _read_tensors(src: Path) -> dict[str, TensorInfo]:
    files, weight_map = _checkpoint_files(src)
    tensors: dict[str, TensorInfo] = {}
    for file in files:
        for name, info in read_header(file).items():
            if name in tensors:
                raise CheckpointError(f"tensor {name} is in both {tensors[name].span.file.name} and {file.name}")
            tensors[name] = info
    for name, fname in weight_map.items():
        if name not in tensors or tensors[name].span.file.name != fname:
            raise CheckpointError(f"{src / SHARD_INDEX} puts {name} in {fname}, but that shard lacks it; "
                                  f"re-download the shard")
    return tensors


def _checkpoint_files(src: Path) -> tuple[list[Path], dict[str, str]]:
    if (src / SHARD_INDEX).exists():
        try:
            weight_map = json.loads((src / SHARD_INDEX).read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{src / SHARD_INDEX} is not a valid shard index: {exc}") from None
        files = [src / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"missing shard(s) {', '.join(missing)} listed in {src / SHARD_INDEX}; "
                                  f"download them into {src}")
        return files, weight_map
    if (src / "model.safetensors").exists():
        return [src / "model.safetensors"], {}
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{src} has no model.safetensors, shard index or *.safetensors file")
    return files, {}


def _split(tensors: dict[str, TensorInfo], arch: Arch, config: MoEConfig,
           src: Path) -> tuple[dict[int, LayerTensors], list[tuple[str, TensorInfo]]]:
    """Sort tensors into each layer's routed experts and everything else (dense)."""
    modules = "|".join(map(re.escape, arch.moe_modules))
    projs = "|".join(map(re.escape, arch.projections))
    per_expert = re.compile(rf"model\.layers\.(\d+)\.({modules})\.experts\.(\d+)\.({projs})\.weight")
    fused = re.compile(rf"model\.layers\.(\d+)\.({modules})\.experts\.(gate_up_proj|down_proj)")
    layer_of = re.compile(r"model\.layers\.(\d+)\.")
    layers: dict[int, LayerTensors] = {}
    dense = []
    for name, info in tensors.items():
        m = layer_of.match(name)
        if m and int(m[1]) >= config.n_layers:
            raise CheckpointError(f"{src}: tensor {name} is in layer {m[1]}, but config.json says "
                                  f"num_hidden_layers={config.n_layers}; the config disagrees with the checkpoint")
        if ".experts." not in name:
            dense.append((name, info))
        elif m_per := per_expert.fullmatch(name):
            lt = layers.setdefault(int(m_per[1]), LayerTensors({}, {}, m_per[2]))
            lt.per_expert[int(m_per[3]), arch.projections.index(m_per[4])] = info
        elif m_fused := fused.fullmatch(name):
            layers.setdefault(int(m_fused[1]), LayerTensors({}, {}, m_fused[2])).fused[m_fused[3]] = info
        else:
            raise CheckpointError(f"{src}: unrecognised expert tensor {name}; expected "
                                  f"model.layers.N.{arch.moe_modules[0]}.experts.E.{arch.projections[0]}.weight "
                                  f"or the fused model.layers.N.mlp.experts.gate_up_proj")
    return layers, dense


def _layer_spans(layer: int, lt: LayerTensors | None, arch: Arch,
                 shape: StoreShape) -> tuple[list[tuple[Span, Span, Span]], set[str]]:
    """The gate, up and down byte ranges of every expert of decoder layer `layer`."""
    module = lt.module if lt else arch.moe_modules[0]
    prefix = f"model.layers.{layer}.{module}.experts"
    if lt is None or (lt.per_expert and lt.fused) or not (lt.per_expert or lt.fused):
        what = "both per-expert and fused" if lt else "no"
        raise CheckpointError(f"layer {layer} has {what} expert tensors; expected {prefix}.E."
                              f"{arch.projections[0]}.weight for every expert, or {prefix}.gate_up_proj")
    if lt.fused:
        return _fused_spans(layer, lt, prefix, shape)
    return _per_expert_spans(layer, lt, prefix, arch, shape)


def _per_expert_spans(layer: int, lt: LayerTensors, prefix: str, arch: Arch,
                      shape: StoreShape) -> tuple[list[tuple[Span, Span, Span]], set[str]]:
    h, i, n = shape.hidden, shape.intermediate, shape.n_experts
    seen = sorted({e for e, _ in lt.per_expert})
    if seen[-1] >= n or (len(seen) < n and seen == list(range(len(seen)))):
        raise CheckpointError(f"config.json says {n} experts, but layer {layer} has tensors for "
                              f"experts {seen[0]}..{seen[-1]}; the config disagrees with the checkpoint")
    spans = []
    for e in range(n):
        parts = []
        for role, want in enumerate([(i, h), (i, h), (h, i)]):
            name = f"{prefix}.{e}.{arch.projections[role]}.weight"
            info = lt.per_expert.get((e, role))
            if info is None:
                raise CheckpointError(f"missing expert tensor {name}; the checkpoint is incomplete")
            _check_shape(info, want, shape)
            parts.append(info.span)
        spans.append(tuple(parts))
    return spans, {t.dtype for t in lt.per_expert.values()}


def _fused_spans(layer: int, lt: LayerTensors, prefix: str,
                 shape: StoreShape) -> tuple[list[tuple[Span, Span, Span]], set[str]]:
    h, i, n = shape.hidden, shape.intermediate, shape.n_experts
    for kind in ("gate_up_proj", "down_proj"):
        if kind not in lt.fused:
            raise CheckpointError(f"missing expert tensor {prefix}.{kind}; the checkpoint is incomplete")
    gate_up, down = lt.fused["gate_up_proj"], lt.fused["down_proj"]
    for info in (gate_up, down):
        if info.shape and info.shape[0] != n:
            raise CheckpointError(f"config.json says {n} experts, but {info.name} stacks {info.shape[0]}; "
                                  f"the config disagrees with the checkpoint")
    _check_shape(gate_up, (n, 2 * i, h), shape)
    _check_shape(down, (n, h, i), shape)
    part = h * i * DTYPES.get(gate_up.dtype, ("", 0))[1]
    g, d = gate_up.span, down.span
    spans = [(Span(g.file, g.offset + 2 * e * part, part), Span(g.file, g.offset + (2 * e + 1) * part, part),
              Span(d.file, d.offset + e * part, part)) for e in range(n)]
    return spans, {gate_up.dtype, down.dtype}


def _check_shape(info: TensorInfo, want: tuple[int, ...], shape: StoreShape) -> None:
    if info.shape != want:
        raise CheckpointError(f"tensor {info.name} has shape {list(info.shape)}, but config.json (hidden_size="
                              f"{shape.hidden}, expert intermediate size {shape.intermediate}) implies {list(want)}; "
                              f"the config disagrees with the checkpoint")


def _check_dense_shapes(dense: dict[str, TensorInfo], config: MoEConfig, arch: Arch) -> None:
    """Embeddings, LM head and routers are where a config that disagrees with the weights shows."""
    want = {"model.embed_tokens.weight": (config.vocab_size, config.dim),
            "lm_head.weight": (config.vocab_size, config.dim)}
    for layer in config.moe_layer_ids:
        for module in arch.moe_modules:
            want[f"model.layers.{layer}.{module}.gate.weight"] = (config.n_experts, config.dim)
    for name, shape in want.items():
        if name in dense and dense[name].shape != shape:
            raise CheckpointError(f"tensor {name} has shape {list(dense[name].shape)}, but config.json (vocab_size="
                                  f"{config.vocab_size}, hidden_size={config.dim}, {config.n_experts} experts) "
                                  f"implies {list(shape)}; the config disagrees with the checkpoint")


def _saved_name(name: str, arch: Arch) -> str:
    """The name save_pretrained gives a dense tensor: a fused-layout Mixtral router lives in `mlp.gate`."""
    if arch.moe_modules[0] != "mlp":
        return re.sub(r"^(model\.layers\.\d+)\.mlp\.gate\.", rf"\1.{arch.moe_modules[0]}.gate.", name)
    return name


# ---------------------------------------------------------------- convert

Progress = Callable[[int, int], None]


def convert(src: Path, dst: Path, overwrite: bool = False, progress: Progress | None = None) -> Index:
    """Convert the checkpoint in `src` into an expert store at `dst`; returns the store's index.

    Raises CheckpointError, before writing anything, if the checkpoint is unusable or `dst` is a
    non-empty directory and `overwrite` is false. `progress(done, total)` is called after each block.
    """
    src, dst = Path(src).expanduser(), Path(dst).expanduser()
    p = plan(src)
    _check_destination(src, dst, overwrite)
    with _Readers() as readers, StoreWriter(dst, p.shape, replace=overwrite) as writer:
        for file in p.files:
            writer.copy_file(file, file.name)
        writer.write_dense(p.dense)
        for done, spans in enumerate(p.blocks, 1):
            writer.add_block(lambda view, spans=spans: readers.read_into(view, spans))
            if progress:
                progress(done, len(p.blocks))
    return writer.index


def _check_destination(src: Path, dst: Path, overwrite: bool) -> None:
    if dst.resolve() == src.resolve():
        raise CheckpointError(f"the destination {dst} is the checkpoint itself; choose another directory")
    if dst.exists() and not dst.is_dir():
        raise CheckpointError(f"the destination {dst} exists and is not a directory; choose another path")
    if dst.exists() and any(dst.iterdir()) and not overwrite:
        raise CheckpointError(f"the destination {dst} already exists and is not empty; choose another directory "
                              f"or pass --overwrite to replace it")


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


# ---------------------------------------------------------------- CLI

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("example:\n  flashmoe-cli convert ~/models/OLMoE-1B-7B-0924 data/olmoe\n\n"
                     "SRC_DIR holds config.json and model.safetensors (or shards with "
                     "model.safetensors.index.json).")
    parser.add_argument("src", metavar="SRC_DIR", type=Path, help="Hugging Face checkpoint directory")
    parser.add_argument("dst", metavar="DST_DIR", type=Path, help="where to write the expert store")
    parser.add_argument("--overwrite", action="store_true", help="replace DST_DIR if it already holds files")


def run(args: argparse.Namespace) -> int:
    start = time.monotonic()
    try:
        index = convert(args.src, args.dst, overwrite=args.overwrite, progress=_log_progress)
    except CheckpointError as exc:
        log.error("convert failed: %s", exc)
        return 1
    except OSError as exc:
        log.error("convert failed: %s; nothing was written to %s", exc, args.dst)
        return 1
    log.info("wrote %s: %d layers x %d experts, %s blocks of %.2f MB (%.1f GB) in %.1f s", args.dst,
             index.n_layers, index.n_experts, index.dtype, index.nbytes / 1e6,
             len(index.blocks) * index.slot_bytes / 1e9, time.monotonic() - start)
    return 0


def _log_progress(done: int, total: int) -> None:
    if done * 10 // total != (done - 1) * 10 // total:
        log.info("converted %d of %d expert blocks", done, total)

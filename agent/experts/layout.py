"""The expert store on disk, as `flashmoe-cli convert` writes it and the expert cache reads it.

    DIR/config.json          the checkpoint's Hugging Face config, unchanged
    DIR/dense.safetensors    every non-expert tensor (embeddings, attention, norms, routers, shared experts)
    DIR/experts.bin          one block per (layer, expert), each starting at a multiple of the index's
                             alignment (ALIGN) so one O_DIRECT read fills a cache slot
    DIR/experts.index.json   the Index below; written last, so a store without it is incomplete

convert writes all of it into a sibling `.DIR.partial-*` directory, renamed to DIR once complete.

What a block holds, its `parts` (the index lists them, so a reader need not know the rule):
- quant null: gate | up | down in the checkpoint's dtype, contiguous. gate and up are [intermediate,
  hidden], down is [hidden, intermediate] (nn.Linear weight order).
- quant "int8": the same three matrices as int8, then, from the next multiple of 64 bytes, their
  scales in the checkpoint's dtype (float32 for float16), one per output channel (row): gate_scale,
  up_scale [intermediate], down_scale [hidden]. A weight is q * scale of its row (agent/experts/quant.py).
- quant "int4": two matrices, gate_up (gate's rows, then up's: [2 x intermediate, hidden]) and down,
  each padded with zero weights to a multiple of INT4_ROWS rows and of INT4_GROUP columns, 4 bits a
  weight packed as torch's int4 kernel reads them on AVX-512 (agent/experts/quant.py, pack_int4); then,
  from the next multiple of 64 bytes, gate_up_sz and down_sz [columns / INT4_GROUP, rows, 2]: a scale
  and a zero for each group of INT4_GROUP weights along a row, in the checkpoint's dtype (float32 for
  float16). A weight is (q - 8) * scale + zero of its group.
A CRC-32 of each block's parts (its padding excluded) is in the index.

Version 1 stores (before quantization; no quant, no parts) are read as quant null.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path

import torch
from isal.isal_zlib import crc32 as isal_crc32

ALIGN = 4096
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
QUANTS = ("int8", "int4")
INT4_GROUP = 64  # weights per scale and zero along a row (BENCHMARKS.md, "int4 experts": error and bytes)
INT4_ROWS = 64   # rows packed together: torch's int4 kernel's block on AVX-512
PART_ALIGN = 64  # where a block's scales start: a cache line, so vector loads of them are aligned
CONFIG, DENSE, EXPERTS, INDEX = "config.json", "dense.safetensors", "experts.bin", "experts.index.json"
_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1}


class StoreError(Exception):
    """The expert store is missing, incomplete or corrupt; the message says which file and block."""


def align_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


@dataclass(frozen=True)
class Block:
    layer: int
    expert: int
    offset: int  # byte offset in experts.bin, a multiple of the index's alignment
    crc32: int   # of the block's nbytes payload (padding excluded)


@dataclass(frozen=True)
class Part:
    """One tensor of a block: name, torch dtype name, shape, byte offset from the block's start."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return _ITEMSIZE[self.dtype] * math.prod(self.shape)

    def view(self, block: torch.Tensor) -> torch.Tensor:
        """This part of a block's bytes (a uint8 tensor), as a tensor of its dtype and shape, without a copy."""
        return block[self.offset:self.offset + self.nbytes].view(getattr(torch, self.dtype)).view(self.shape)

    def listed(self) -> list:
        """As the index file lists it."""
        return [self.name, self.dtype, list(self.shape), self.offset]


@dataclass
class Index:
    n_layers: int
    n_experts: int
    hidden: int
    intermediate: int
    dtype: str            # the checkpoint's torch dtype name, e.g. "float32", "bfloat16": the model computes in it
    itemsize: int         # of dtype
    alignment: int
    blocks: list[Block]
    quant: str | None = None  # None: experts in dtype; "int8": per-output-channel scales; "int4": group-wise
    version: int = FORMAT_VERSION
    dense_crc32: int | None = None  # of dense.safetensors; None in stores written before it was kept
    parts: tuple[Part, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.parts = self._layout()

    def _layout(self) -> tuple[Part, ...]:
        h, i = self.hidden, self.intermediate
        if self.quant == "int4":
            return _int4_layout({"gate_up": (2 * i, h), "down": (h, i)}, self.scale_dtype)
        weights = [("gate", (i, h)), ("up", (i, h)), ("down", (h, i))]
        parts = _contiguous([(name, self.quant or self.dtype, shape) for name, shape in weights], 0)
        if self.quant:  # one scale per output channel (row), after the weights
            parts += _contiguous([(f"{name}_scale", self.scale_dtype, shape[:1]) for name, shape in weights],
                                 align_up(_end(parts), PART_ALIGN))
        return tuple(parts)

    @property
    def scale_dtype(self) -> str:
        """The dtype of a quantized block's scales: the model's, but float32 for float16, whose range
        cannot hold the scale of a row of small weights (max |w| / 127 underflows)."""
        return "float32" if self.dtype == "float16" else self.dtype

    @cached_property
    def nbytes(self) -> int:
        """Payload bytes of one block: every part, padding between them included."""
        return _end(self.parts)

    @property
    def slot_bytes(self) -> int:
        """Bytes one block occupies on disk and in a cache slot (payload rounded up to alignment)."""
        return align_up(self.nbytes, self.alignment)

    def block(self, layer: int, expert: int) -> Block:
        return self.blocks[layer * self.n_experts + expert]

    def save(self, path: Path) -> None:
        data = asdict(self)
        data["blocks"] = [[b.layer, b.expert, b.offset, b.crc32] for b in self.blocks]
        data["parts"] = [p.listed() for p in self.parts]
        path.write_text(json.dumps(data))

    @classmethod
    def load(cls, path: Path) -> "Index":
        try:
            data = json.loads(Path(path).read_text())
            _check_kind(data, path)
            parts = data.pop("parts", None)
            data["blocks"] = [Block(*b) for b in data["blocks"]]
            index = cls(**data)
        except FileNotFoundError:
            raise _missing_index(Path(path)) from None
        except (ValueError, TypeError, KeyError) as exc:
            raise StoreError(f"{path} is not a valid expert index: {exc}") from None
        _check_blocks(index, parts, path)
        return index


def int4_padded(rows: int, columns: int) -> tuple[int, int]:
    """The shape an int4 matrix is stored in: zero weights added up to whole row blocks and groups."""
    return align_up(rows, INT4_ROWS), align_up(columns, INT4_GROUP)


def _int4_layout(matrices: dict[str, tuple[int, int]], scale_dtype: str) -> tuple[Part, ...]:
    padded = {name: int4_padded(*shape) for name, shape in matrices.items()}
    parts = _contiguous([(name, "uint8", (n, k // 2)) for name, (n, k) in padded.items()], 0)
    return tuple(parts + _contiguous([(f"{name}_sz", scale_dtype, (k // INT4_GROUP, n, 2))
                                      for name, (n, k) in padded.items()], align_up(_end(parts), PART_ALIGN)))


def _contiguous(specs: list[tuple[str, str, tuple[int, ...]]], start: int) -> list[Part]:
    parts = []
    for name, dtype, shape in specs:
        parts.append(Part(name, dtype, shape, _end(parts) if parts else start))
    return parts


def _end(parts) -> int:
    return parts[-1].offset + parts[-1].nbytes


def _check_kind(data: object, path: Path) -> None:
    """A version this code reads, blocks of a kind it knows, positive sizes (before any are used)."""
    if not isinstance(data, dict) or data.get("version") not in READABLE_VERSIONS:
        version = data.get("version") if isinstance(data, dict) else None
        raise StoreError(f"{path}: format version {version} is not one this flashmoe reads "
                         f"({', '.join(map(str, READABLE_VERSIONS))}); re-run flashmoe-cli convert")
    for key, known in (("quant", (None, *QUANTS)), ("dtype", tuple(_ITEMSIZE))):
        if data.get(key) not in known:
            raise StoreError(f"{path}: blocks with {key} {data.get(key)!r} are not a kind this flashmoe reads "
                             f"(it knows {', '.join(map(str, known))}); re-run flashmoe-cli convert")
    sizes = ("n_layers", "n_experts", "hidden", "intermediate", "itemsize", "alignment")
    if not all(type(data.get(k)) is int and data[k] > 0 for k in sizes):
        raise StoreError(f"{path} is not a valid expert index: {', '.join(sizes)} must be positive integers")


def _check_blocks(index: Index, parts: list | None, path: Path) -> None:
    if len(index.blocks) != index.n_layers * index.n_experts:
        raise StoreError(f"{path}: {len(index.blocks)} blocks, expected {index.n_layers} x {index.n_experts}")
    for i, b in enumerate(index.blocks):  # block() finds a block by its place; reads need aligned offsets
        if ((b.layer, b.expert) != divmod(i, index.n_experts) or type(b.offset) is not int or b.offset < 0
                or b.offset % index.alignment or type(b.crc32) is not int):
            raise StoreError(f"{path}: block {i} is {[b.layer, b.expert, b.offset, b.crc32]}, expected [layer, expert, "
                             f"offset, crc32] for layer {i // index.n_experts} expert {i % index.n_experts} at an "
                             f"offset that is a multiple of {index.alignment}; re-run flashmoe-cli convert")
    if index.dense_crc32 is not None and not (type(index.dense_crc32) is int and 0 <= index.dense_crc32 < 1 << 32):
        raise StoreError(f"{path}: dense_crc32 is {index.dense_crc32!r}, expected a crc32 (a whole number "
                         "from 0 to 2**32 - 1) or null; re-run flashmoe-cli convert")
    if index.version > 1 and parts != [p.listed() for p in index.parts]:
        raise StoreError(f"{path}: the block layout it lists is not the one this flashmoe reads for "
                         f"{index.quant or index.dtype} blocks; re-run flashmoe-cli convert")


def partial_prefix(store_dir: Path) -> str:
    """Name prefix of the temporary directory convert writes beside `store_dir` until it is complete."""
    return f".{store_dir.name}.partial-"


def _missing_index(path: Path) -> StoreError:
    """No index at `path`: convert stopped before writing it (experts.bin, or its partial directory,
    is there), or there is no store at all."""
    store = path.parent
    if (store / EXPERTS).exists() or any(store.parent.glob(partial_prefix(store) + "*")):
        return StoreError(f"{path} is missing: the store is incomplete (was convert interrupted?); "
                          f"re-run flashmoe-cli convert")
    missing = path if store.is_dir() else store
    return StoreError(f"{missing} does not exist, so {store} is not an expert store; write one with "
                      f"`flashmoe-cli convert SRC_HF_DIR {store}` (or `flashmoe-cli init-demo --out {store}` "
                      f"for the random-weight demo model)")


def crc32(buf, crc: int = 0) -> int:
    """zlib's CRC-32 (every store's checksums are), by isal: SIMD, 3.5x zlib's speed here, the GIL released
    (blocks are checked on the I/O threads)."""
    return isal_crc32(buf, crc)


def file_crc32(path: Path, chunk: int = 1 << 24) -> int:
    """crc32 of a whole file, read in chunks (a dense file can be gigabytes)."""
    crc = 0
    with open(path, "rb") as f:
        while data := f.read(chunk):
            crc = crc32(data, crc)
    return crc


def drop_page_cache(path: Path) -> None:
    """Ask the kernel to drop the file's clean pages from the page cache (dirty ones stay until written)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)

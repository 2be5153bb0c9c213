"""The expert store on disk, as `flashmoe-cli convert` writes it and the expert cache reads it.

    DIR/config.json          the checkpoint's Hugging Face config, unchanged
    DIR/dense.safetensors    every non-expert tensor (embeddings, attention, norms, routers, shared experts)
    DIR/experts.bin          one block per (layer, expert): gate | up | down, contiguous, original dtype,
                             each block starting at a multiple of ALIGN so one O_DIRECT read fills a slot
    DIR/experts.index.json   the Index below; written last, so a store without it is incomplete

convert writes all of it into a sibling `.DIR.partial-*` directory, renamed to DIR once complete.

gate and up are [intermediate, hidden], down is [hidden, intermediate] (nn.Linear weight order).
"""
from __future__ import annotations

import json
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

ALIGN = 4096
FORMAT_VERSION = 1
CONFIG, DENSE, EXPERTS, INDEX = "config.json", "dense.safetensors", "experts.bin", "experts.index.json"


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


@dataclass
class Index:
    n_layers: int
    n_experts: int
    hidden: int
    intermediate: int
    dtype: str            # torch dtype name, e.g. "float32", "bfloat16"
    itemsize: int
    alignment: int
    blocks: list[Block]
    version: int = FORMAT_VERSION

    @property
    def nbytes(self) -> int:
        """Payload bytes of one block: gate, up and down."""
        return 3 * self.hidden * self.intermediate * self.itemsize

    @property
    def slot_bytes(self) -> int:
        """Bytes one block occupies on disk and in a cache slot (payload rounded up to alignment)."""
        return align_up(self.nbytes, self.alignment)

    def block(self, layer: int, expert: int) -> Block:
        return self.blocks[layer * self.n_experts + expert]

    def save(self, path: Path) -> None:
        data = asdict(self)
        data["blocks"] = [[b.layer, b.expert, b.offset, b.crc32] for b in self.blocks]
        path.write_text(json.dumps(data))

    @classmethod
    def load(cls, path: Path) -> "Index":
        try:
            data = json.loads(Path(path).read_text())
            if data.get("version") != FORMAT_VERSION:
                raise StoreError(f"{path}: format version {data.get('version')} is not {FORMAT_VERSION}; re-run flashmoe-cli convert")
            data["blocks"] = [Block(*b) for b in data["blocks"]]
            index = cls(**data)
        except FileNotFoundError:
            raise _missing_index(Path(path)) from None
        except (ValueError, TypeError, KeyError) as exc:
            raise StoreError(f"{path} is not a valid expert index: {exc}") from None
        if len(index.blocks) != index.n_layers * index.n_experts:
            raise StoreError(f"{path}: {len(index.blocks)} blocks, expected {index.n_layers} x {index.n_experts}")
        return index


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


def crc32(buf) -> int:
    return zlib.crc32(buf) & 0xFFFFFFFF

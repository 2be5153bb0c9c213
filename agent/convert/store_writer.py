"""StoreWriter: writes one expert store (the layout of agent/experts/layout.py) block by block.

Everything goes to a temporary directory beside the destination, the index is written last and the
directory is renamed into place only when complete, so an interrupted run never leaves something
that looks like a store. convert and init-demo both write through it.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.convert.errors import CheckpointError
from agent.convert.safetensors_io import DenseSource, write_safetensors
from agent.experts.layout import ALIGN, CONFIG, DENSE, EXPERTS, INDEX, Block, Index, crc32, file_crc32, partial_prefix
from agent.tokenizer import TOKENIZER_JSON
from store.database import missing_parents, remove_empty

log = logging.getLogger(__name__)

STORE_FILES = frozenset({CONFIG, DENSE, EXPERTS, INDEX, TOKENIZER_JSON})   # all a store writer puts in a store


@dataclass(frozen=True)
class StoreShape:
    n_layers: int
    n_experts: int
    hidden: int
    intermediate: int
    dtype: str      # torch dtype name
    itemsize: int
    quant: str | None = None  # None: blocks in dtype; "int8" (agent/experts/quant.py)


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
                           shape.itemsize, alignment=ALIGN, blocks=[], quant=shape.quant)
        self._made = missing_parents(self.dst)   # removed again if the write fails
        self.tmp: Path | None = None
        self._fd = -1
        try:   # even this can fail (a disk out of inodes): nothing made is left
            self.dst.parent.mkdir(parents=True, exist_ok=True)
            _remove_stale_partials(self.dst)
            self.tmp = Path(tempfile.mkdtemp(prefix=partial_prefix(self.dst), dir=self.dst.parent))
            self._fd = os.open(self.tmp / EXPERTS, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except BaseException:
            self._abort()
            raise
        self._slot = bytearray(self.index.slot_bytes)  # the padding after the payload stays zero

    @property
    def n_blocks(self) -> int:
        return self.index.n_layers * self.index.n_experts

    def check_room(self, other_bytes: int, flag: str) -> None:
        """Fail now, not hours into the write, if the disk of `dst` lacks room for the blocks and `other_bytes`;
        `flag` is the option that chose `dst`."""
        replacing = self.replace and self.dst.is_dir() and any(self.dst.iterdir())
        check_room(self.dst, self.n_blocks * self.index.slot_bytes + other_bytes, flag,
                   note=" (the store it replaces is kept until the new one is whole)" if replacing else "")

    def write_config(self, config: dict) -> None:
        self.write_text(CONFIG, json.dumps(config, indent=2) + "\n")

    def write_text(self, name: str, text: str) -> None:
        (self.tmp / name).write_text(text)

    def copy_file(self, src: Path, name: str) -> None:
        shutil.copyfile(src, self.tmp / name)

    def write_dense(self, tensors: Sequence[tuple[str, DenseSource]]) -> None:
        write_safetensors(self.tmp / DENSE, tensors)
        self.index.dense_crc32 = file_crc32(self.tmp / DENSE)  # read back from the page cache

    def add_block(self, fill: Callable[[memoryview], None]) -> Block:
        """Append the next (layer, expert) block; `fill` writes gate|up|down into the payload view."""
        i = len(self.index.blocks)
        if i >= self.n_blocks:
            raise ValueError(f"the store already has all {self.n_blocks} blocks")
        payload = memoryview(self._slot)[: self.index.nbytes]
        fill(payload)
        block = Block(i // self.index.n_experts, i % self.index.n_experts,
                      offset=i * self.index.slot_bytes, crc32=crc32(payload))
        _write_all(self._fd, memoryview(self._slot))
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
        # rename replaces an empty directory
        if self.dst.exists() and not (self.dst.is_dir() and not any(self.dst.iterdir())):
            if not self.replace:
                raise CheckpointError(f"{self.dst} appeared while writing; nothing was replaced")
            old = Path(tempfile.mkdtemp(prefix=_replaced_prefix(self.dst), dir=self.dst.parent))
            os.rename(self.dst, old / "store")
        os.rename(self.tmp, self.dst)
        _fsync_path(self.dst.parent)
        _remove_replaced(self.dst, old)

    def _abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        remove_empty(self._made)


def check_room(dst: Path, need: int, flag: str, what: str = "the store", note: str = "") -> None:
    """Fail now, not hours into the write, if the disk that holds (or is to hold) `dst` has less than `need`
    bytes free; the error names `what` needs them and the option, `flag`, that chose `dst`."""
    disk = os.statvfs(next(p for p in (dst, *dst.absolute().parents) if p.exists()))
    free = disk.f_bavail * disk.f_frsize
    if need > free:
        raise CheckpointError(f"{what} needs {need / 1e6:,.1f} MB and the disk of {dst} has {free / 1e6:,.1f} MB "
                              f"free{note}; free space there or choose another {flag}")


def filled_up(exc: OSError, dst: Path, flag: str) -> str | None:
    """What to say when writing `dst` failed for want of room after check_room found it (another writer took
    it), or None for any other error; a StoreWriter leaves nothing of its write behind."""
    if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
        return None
    return (f"the disk of {dst} filled up while writing ({exc.strerror}); nothing was written to {dst}: "
            f"free space there or choose another {flag}")


def check_replaceable(dst: Path, flag: str) -> None:
    """`dst` may be replaced only if it is an expert store (its index and only the files a store holds): what
    `flag` deletes must never be a directory of the user's given by mistake."""
    others = foreign_names(dst, STORE_FILES.__contains__)
    if others or not (dst / INDEX).is_file():
        raise CheckpointError(f"{dst} is not an expert store (it holds {listed(others or foreign_names(dst))}); "
                              f"{flag} replaces only an expert store: choose another directory or remove it yourself")


def followed(dst: Path, flag: str) -> Path:
    """Where a store given as `dst` goes: `dst`, or the directory a symlink `dst` names (data/model -> /mnt/nvme/m,
    a store on the SSD), so that it is written beside that, on its disk, and renamed onto it. Kept as the link,
    the store was written beside the link and its rename onto the link failed (ENOTDIR) after the last block."""
    try:
        resolved = dst.resolve()   # also finds a loop in dst's parents
    except RuntimeError:           # pathlib's "Symlink loop from ..."
        raise CheckpointError(f"{flag} {dst} is a symlink loop (it leads back to itself); point the link at a "
                              f"directory or choose another {flag}") from None
    return resolved if dst.is_symlink() else dst


def check_outside_models(dst: Path, flag: str) -> None:
    """`dst` must not be inside another model's directory: it would go with that model when the model is replaced
    or removed (init-demo's rebuild, convert --overwrite, --drop-hf), and stop convert --overwrite replacing it."""
    model = next((d for d in Path(dst).resolve().parents if _holds_model(d)), None)
    if model is not None:
        raise CheckpointError(f"{dst} would be written inside the model {model} (its config.json and safetensors "
                              f"weights); choose another {flag} outside it")


def _holds_model(directory: Path) -> bool:
    """A model directory, as convert reads a checkpoint and as every expert store is: config.json beside
    safetensors weights (the checkpoint's shards; the store's dense.safetensors)."""
    return (directory / CONFIG).is_file() and any(directory.glob("*.safetensors"))


def foreign_names(directory: Path, ours: Callable[[str], bool] = lambda name: False) -> list[str]:
    """What in `directory` is not a file named as `ours` takes (a directory is named with a trailing /)."""
    return sorted(p.name + ("/" if p.is_dir() else "") for p in directory.iterdir()
                  if not (p.is_file() and ours(p.name)))


def listed(names: Sequence[str], most: int = 3) -> str:
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def _remove_stale_partials(dst: Path) -> None:
    """A killed writer leaves its temporary directory behind; the next run of the same dst clears it."""
    for stale in dst.parent.glob(partial_prefix(dst) + "*"):
        log.warning("removing %s, left by an interrupted run", stale)
        shutil.rmtree(stale, ignore_errors=True)


def _replaced_prefix(dst: Path) -> str:
    return f".{dst.name}.old-"


def _remove_replaced(dst: Path, ours: Path | None) -> None:
    """Remove the store this run replaced, and any a run killed while removing its own left (gigabytes
    no one would find), now that a whole store is in place."""
    for old in dst.parent.glob(_replaced_prefix(dst) + "*"):
        if old != ours:
            log.warning("removing %s, the store an interrupted --overwrite replaced", old)
        shutil.rmtree(old, ignore_errors=True)


def _write_all(fd: int, data: memoryview) -> None:
    """os.write may write part of `data` (a disk filling up): the rest goes on, or its error is raised."""
    while data:
        data = data[os.write(fd, data):]


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

"""Read one (layer, expert) block of experts.bin: three backends behind one small interface.

- direct:   O_DIRECT preadv straight into an aligned cache slot; the page cache is bypassed, so the
            cache's hit rate is the whole story (the default, and the honest measurement).
- buffered: plain pread into the slot; the kernel's page cache sits underneath, double-buffering.
- mmap:     the whole file mapped; a block is a view into the mapping and the page cache decides
            what stays in RAM (how llama.cpp runs models larger than RAM). No slots are used.

Every backend checks the block's CRC32 when asked (the default) and raises StoreError naming the
layer, expert and file on a mismatch or short read, so garbage never reaches the model.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from pathlib import Path
from typing import ClassVar

import numpy as np

from agent.experts.layout import ALIGN, EXPERTS, INDEX, Block, Index, StoreError, crc32
from agent.experts.slots import SlotPool

BACKENDS = ("direct", "buffered", "mmap")
IO_THREADS = 8  # reads in flight: the demo's virtio disk gives ~510 MB/s with 4 queued 3 MiB reads, ~730 with 8

_STATX_DIOALIGN = 0x2000
_AT_FDCWD = -100
_libc = ctypes.CDLL(None, use_errno=True)


def dio_alignment(path: Path) -> tuple[int, int]:
    """(memory, file offset) alignment O_DIRECT needs on path's filesystem, from statx; 4096 if unknown."""
    try:
        buf = ctypes.create_string_buffer(256)  # struct statx
        if _libc.statx(_AT_FDCWD, os.fsencode(path), 0, _STATX_DIOALIGN, buf) == 0:
            mask = int.from_bytes(buf.raw[0:4], "little")
            mem, off = int.from_bytes(buf.raw[152:156], "little"), int.from_bytes(buf.raw[156:160], "little")
            if mask & _STATX_DIOALIGN and mem and off:
                return mem, off
    except (AttributeError, OSError):  # no statx in this libc
        pass
    return ALIGN, ALIGN


class BlockReader:
    """Loads blocks of one experts.bin. `load` returns the block's nbytes as a uint8 array."""
    name: ClassVar[str] = ""
    uses_slots: ClassVar[bool] = True

    def __init__(self, path: Path, index: Index, verify: bool = True) -> None:
        self.path, self.index, self.verify = Path(path), index, verify

    def load(self, block: Block, slot: memoryview | None) -> np.ndarray:
        data = self.read(block, slot)
        self.check(block, data)
        return data

    def check(self, block: Block, data: np.ndarray) -> None:
        """StoreError if verifying and the block's bytes fail its CRC32."""
        if self.verify and crc32(data) != block.crc32:
            raise StoreError(f"expert block layer {block.layer} expert {block.expert} fails its CRC32 check in "
                             f"{self.path}: the file is corrupt; re-run flashmoe-cli convert")

    def read(self, block: Block, slot: memoryview | None) -> np.ndarray:
        raise NotImplementedError

    def _short(self, block: Block, got: int) -> StoreError:
        return StoreError(f"expert block layer {block.layer} expert {block.expert} is truncated in {self.path}: "
                          f"read {got} of {self.index.nbytes} bytes at offset {block.offset}; "
                          "re-run flashmoe-cli convert")

    def close(self) -> None:
        pass


class _PreadReader(BlockReader):
    """Reads with preadv from a file descriptor opened with extra flags."""
    flags: ClassVar[int] = 0

    def __init__(self, path: Path, index: Index, verify: bool = True) -> None:
        super().__init__(path, index, verify)
        self.fd = self._open()

    def _open(self) -> int:
        return os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | self.flags)

    def _length(self) -> int:
        return self.index.nbytes

    def read(self, block: Block, slot: memoryview | None) -> np.ndarray:
        want, done = self._length(), 0
        while done < self.index.nbytes:
            n = os.preadv(self.fd, [slot[done:want]], block.offset + done)
            done += n
            if n == 0 or n % mmap.PAGESIZE:  # end of file (O_DIRECT cannot go on from an unaligned offset)
                break
        if done < self.index.nbytes:
            raise self._short(block, done)
        return np.frombuffer(slot, dtype=np.uint8, count=self.index.nbytes)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class DirectReader(_PreadReader):
    name = "direct"
    flags = os.O_DIRECT

    def _open(self) -> int:
        mem, off = dio_alignment(self.path)
        if self.index.alignment % off or self.index.slot_bytes % mem or mmap.PAGESIZE % mem:
            raise StoreError(f"{self.path}: its filesystem needs O_DIRECT alignment of {off} bytes (memory {mem}) but "
                             f"the store is aligned to {self.index.alignment}; use --backend buffered or re-convert")
        try:
            return super()._open()
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                raise StoreError(f"the filesystem holding {self.path} refuses O_DIRECT; "
                                 "use --backend buffered") from None
            raise

    def _length(self) -> int:
        return self.index.slot_bytes  # whole aligned extent; the last block may end early at EOF


class BufferedReader(_PreadReader):
    name = "buffered"


class MmapReader(BlockReader):
    name = "mmap"
    uses_slots = False

    def __init__(self, path: Path, index: Index, verify: bool = True) -> None:
        super().__init__(path, index, verify)
        with open(self.path, "rb") as f:
            # ACCESS_COPY: a private mapping (writable views for torch, never written back), still page-cache backed.
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        self._base = self._bytes.ctypes.data
        self._local = threading.local()

    def read(self, block: Block, slot: memoryview | None) -> np.ndarray:
        data = self._bytes[block.offset:block.offset + self.index.nbytes]
        if len(data) < self.index.nbytes:
            raise self._short(block, len(data))
        if not self.verify:
            data[::mmap.PAGESIZE].sum()  # touch every page: a miss costs its read now, as in the other backends
        return data

    def resident_bytes(self, block: Block) -> int:
        """Bytes of the block already in the page cache (mincore), to count what a fault really reads."""
        start = block.offset - block.offset % mmap.PAGESIZE
        length = block.offset + self.index.nbytes - start
        vec = self._mincore_vector(-(-length // mmap.PAGESIZE))
        if _libc.mincore(ctypes.c_void_p(self._base + start), ctypes.c_size_t(length), vec) != 0:
            return 0
        return int(np.count_nonzero(np.frombuffer(vec, dtype=np.uint8) & 1)) * mmap.PAGESIZE

    def _mincore_vector(self, pages: int) -> ctypes.Array:
        """A per-thread result buffer: this runs on every get() of the decode thread, so no allocation."""
        vec = getattr(self._local, "vec", None)
        if vec is None or len(vec) != pages:
            vec = self._local.vec = ctypes.create_string_buffer(pages)
        return vec

    def close(self) -> None:
        self._bytes = None
        try:
            self._map.close()
        except BufferError:  # views handed out are still alive; the mapping goes when they do
            pass


_READERS: dict[str, type[BlockReader]] = {r.name: r for r in (DirectReader, BufferedReader, MmapReader)}


def open_reader(backend: str, path: Path, index: Index, verify: bool = True) -> BlockReader:
    try:
        cls = _READERS[backend]
    except KeyError:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}") from None
    try:
        return cls(path, index, verify)
    except FileNotFoundError:
        raise StoreError(f"{path} is missing: the store is incomplete; re-run flashmoe-cli convert") from None


def check_blocks(store_dir: Path) -> int:
    """Read every expert block of a store with O_DIRECT and check its CRC32 (StoreError on the first
    bad one); returns the number checked. Used before deleting the checkpoint a store came from."""
    index = Index.load(Path(store_dir) / INDEX)
    reader, pool = DirectReader(Path(store_dir) / EXPERTS, index), SlotPool(1, index.slot_bytes)
    try:
        for block in index.blocks:
            reader.load(block, pool.buffer(0))
    finally:
        reader.close()
        pool.close()
    return len(index.blocks)

"""The cache's slot pool: page-aligned RAM for expert blocks, allocated up front.

Each slot holds one block (Index.slot_bytes, a multiple of the O_DIRECT alignment), so a miss reads
straight into a slot and the model views the bytes as tensors without a copy. Memory comes in
arenas, one anonymous mmap each (page aligned by construction, pre-faulted so a read never waits on
page faults). Growing adds an arena, whose memory its owner may reserve beforehand, outside its own
lock; shrinking releases free slots, returning their pages to the OS at once (MADV_DONTNEED) and
unmapping an arena once none of its slots is live.
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class _Arena:
    mem: mmap.mmap
    first: int              # id of the arena's first slot


class SlotPool:
    def __init__(self, n: int, slot_bytes: int) -> None:
        if slot_bytes <= 0 or slot_bytes % mmap.PAGESIZE:
            raise ValueError(f"slot size {slot_bytes} must be a positive multiple of the page size {mmap.PAGESIZE}")
        self.slot_bytes = slot_bytes
        self._arena_of: dict[int, _Arena] = {}
        self._views: dict[int, torch.Tensor] = {}
        self._free: list[int] = []
        self._next_id = 0
        self.grow(n)

    def __len__(self) -> int:
        """Slots allocated (free or in use)."""
        return len(self._arena_of)

    def __contains__(self, slot: int) -> bool:
        return slot in self._arena_of

    @property
    def free(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        """Take a free slot; IndexError when none is left (the cache evicts first)."""
        return self._free.pop()

    def give_back(self, slot: int) -> None:
        """Return a slot to the free list (its bytes stay allocated for the next block)."""
        self._free.append(slot)

    def tensor(self, slot: int) -> torch.Tensor:
        """The slot as a uint8 tensor of slot_bytes, sharing its memory."""
        return self._views[slot]

    def buffer(self, slot: int) -> memoryview:
        """The slot as a writable memoryview, for os.preadv."""
        return memoryview(self._views[slot].numpy()).cast("B")

    def reserve(self, n: int) -> mmap.mmap:
        """Memory for n slots, faulted in now. It touches no pool state, so the pool's owner may call it
        outside its lock: near a memory limit the kernel reclaims for every page, for seconds."""
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        return mmap.mmap(-1, n * self.slot_bytes, flags=flags)

    def grow(self, n: int, memory: mmap.mmap | None = None) -> None:
        """Add n slots in one new arena: `memory` from reserve(n), or reserved now (also when `memory`
        was reserved for another count, e.g. before a concurrent change)."""
        if n <= 0:
            return
        if memory is None or len(memory) != n * self.slot_bytes:
            memory = self.reserve(n)
        arena = _Arena(memory, self._next_id)
        whole = torch.from_numpy(np.frombuffer(arena.mem, dtype=np.uint8))
        for i in range(n):
            slot = self._next_id + i
            self._views[slot] = whole[i * self.slot_bytes:(i + 1) * self.slot_bytes]
            self._arena_of[slot] = arena
        self._free.extend(range(self._next_id + n - 1, self._next_id - 1, -1))  # lowest ids handed out first
        self._next_id += n

    def shrink(self, n: int) -> list[torch.Tensor]:
        """Release n free slots, newest arenas first so whole arenas can be unmapped. Returns their
        views, for the caller to drop where freeing a tensor may wait (see ExpertCache._take_dropped)."""
        if n > len(self._free):
            raise ValueError(f"cannot release {n} slots: only {len(self._free)} are free (evict first)")
        self._free.sort(reverse=True)  # highest ids (newest arenas) released; lowest still handed out first
        views = [self._release(slot) for slot in self._free[:n]]
        del self._free[:n]
        return views

    def _release(self, slot: int) -> torch.Tensor:
        arena = self._arena_of.pop(slot)
        # Pages go back to the OS now; the arena is unmapped once no slot table or tensor refers to it.
        arena.mem.madvise(mmap.MADV_DONTNEED, (slot - arena.first) * self.slot_bytes, self.slot_bytes)
        return self._views.pop(slot)

    def close(self) -> None:
        self._views.clear()
        self._arena_of.clear()
        self._free.clear()

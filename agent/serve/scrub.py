"""The expert store's health: which blocks are damaged, found three ways.

- at start, a size check: blocks that end past the end of experts.bin are truncated (no read needed);
- while serving, a block whose read fails its CRC32 or comes back short (the cache's `damaged`);
- with `serve --verify`, a scrub: a background thread reads every block once and checks its CRC32,
  one block at a time and only while the scheduler is idle, so it never delays a request.

`/v1/status` reports the union under "store". A damaged block fails only the requests that route
to it (agent.serve.scheduler retries a failed batch step one request at a time).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.experts.layout import EXPERTS, Index, StoreError
from agent.experts.reader import open_reader
from agent.experts.slots import SlotPool

log = logging.getLogger(__name__)

Key = tuple[int, int]
IDLE_POLL_S = 0.05     # how often a paused scrub looks whether the scheduler is idle again


def truncated(store_dir: Path, index: Index) -> dict[Key, str]:
    """Blocks that end past the end of experts.bin, each with the reason."""
    path = Path(store_dir) / EXPERTS
    size = os.path.getsize(path)
    return {(b.layer, b.expert): f"expert block layer {b.layer} expert {b.expert} is truncated in {path}: it ends at "
                                 f"byte {b.offset + index.nbytes} but the file has {size}; re-run flashmoe-cli convert"
            for b in index.blocks if b.offset + index.nbytes > size}


@dataclass
class Scrub:
    """Checks every block's CRC32 once, in index order, pausing while `busy()` is true."""
    store_dir: Path
    index: Index
    backend: str
    busy: Callable[[], bool]
    damaged: dict[Key, str] = field(default_factory=dict)
    checked: int = 0
    started: float = 0.0
    finished: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self.started = time.time()
        self._thread = threading.Thread(target=self._run, name="scrub", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _run(self) -> None:
        reader = open_reader(self.backend, Path(self.store_dir) / EXPERTS, self.index, verify=True)
        pool = SlotPool(1, self.index.slot_bytes) if reader.uses_slots else None
        try:
            for block in self.index.blocks:
                while self.busy():
                    if self._stop.wait(IDLE_POLL_S):
                        return
                if self._stop.is_set():
                    return
                try:
                    reader.load(block, None if pool is None else pool.buffer(0))
                except StoreError as exc:
                    self.damaged[(block.layer, block.expert)] = str(exc)
                self.checked += 1
            self.finished = time.time()
            log.info("store verified: %d blocks in %.1f s, %d damaged%s", self.checked, self.finished - self.started,
                     len(self.damaged), "".join(f"\n  {reason}" for reason in self.damaged.values()))
        except Exception:
            log.exception("the store scrub stopped after %d blocks", self.checked)
        finally:
            reader.close()
            if pool is not None:
                pool.close()

    def describe(self) -> dict[str, Any]:
        running = self._thread is not None and self._thread.is_alive()
        state = "done" if self.finished else "running" if running else "stopped"
        return {"state": state, "checked_blocks": self.checked, "started": self.started,
                "finished": self.finished or None}

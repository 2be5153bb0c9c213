"""SSD utilisation for dynamic batching, and which block device holds the model.

Utilisation is iostat's %util / 100: the share of time the device had I/O in flight. Sources, in
order: the collector's `block.<dev>.util` series for the device holding the expert store, when
the store has a point from the last few seconds; else the agent reads the same counters itself
(/sys/block/<dev>/stat, with the collector's parser and arithmetic); else, when the store is on
no block device (tmpfs, overlay), the cache's own read-busy share (time in expert reads over the
interval, capped at 1), which counts only this agent's reads.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

from collector.block import BlockStat, block_rates, read_stat

log = logging.getLogger(__name__)

FRESH_S = 3.0


def block_device(path: Path) -> str | None:
    """The whole-disk name (e.g. "vda", "nvme0n1") holding `path`, or None if it is on no block device."""
    import pyudev

    from collector.devices import disk_holding
    try:
        return disk_holding(path, pyudev.Context()).name
    except (ValueError, OSError):
        return None


class SsdUtil:
    def __init__(self, model_dir: Path, store=None) -> None:
        self.device = block_device(Path(model_dir))
        self.store = store
        self.last: float | None = None
        self.source = "none yet"
        self._stat: BlockStat | None = None
        log.info("SSD utilisation of %s from %s", model_dir,
                 f"block device {self.device}" if self.device else "the cache's read-busy time (no block device)")

    def read(self, read_busy: float) -> float | None:
        """The current utilisation, 0..1 (None until two readings exist); `read_busy` is the cache's estimate."""
        value = self._collector()
        if value is not None:
            self.last, self.source = value, f"collector block.{self.device}.util"
        elif self.device is not None:
            self.last, self.source = self._own_reading(), f"/sys/block/{self.device}/stat"
        else:
            self.last, self.source = read_busy, "expert cache read-busy time"
        return self.last

    def _collector(self) -> float | None:
        if self.store is None or self.device is None:
            return None
        from store.queries import latest
        point = latest(self.store.path, f"block.{self.device}.util")
        if point is None or time.time() - point[0] > FRESH_S:
            return None
        return float(point[1])

    def _own_reading(self) -> float | None:
        current = read_stat(self.device, time.monotonic())
        previous, self._stat = self._stat, current
        if previous is None or current.t <= previous.t:
            return None
        return block_rates(previous, current).util

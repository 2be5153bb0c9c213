"""SSD utilisation for dynamic batching, and which block device holds the model.

Source, in order: the collector's `block.<dev>.util` series (iostat's %util / 100, the share of
time the device had I/O in flight) for the device holding the expert store, when the store has a
point from the last few seconds; otherwise the cache's own read-busy share (the time spent in
expert reads over the interval, capped at 1), which counts only this agent's reads.
"""
from __future__ import annotations

import time
from pathlib import Path

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

    def read(self, read_busy: float) -> float:
        """The current utilisation, 0..1; `read_busy` is the cache's estimate for the last interval."""
        value = self._collector()
        if value is not None:
            self.last, self.source = value, f"collector block.{self.device}.util"
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

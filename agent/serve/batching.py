"""Dynamic batching: the batch limit follows SSD utilisation.

While the SSD is busier than `ssd_util_threshold`, adding sequences to a step only lengthens the
read queue every one of them waits on, so the limit shrinks to max(1, floor(0.8 x limit)) each
interval; once utilisation falls back it recovers by the inverse step up to max_batch_size.
"""
from __future__ import annotations

import math

SHRINK = 0.8


def next_limit(limit: int, max_batch: int, util: float | None, threshold: float) -> int:
    """The batch limit for the next interval. `util` None (no measurement yet) counts as not busy."""
    limit = min(limit, max_batch)
    if util is not None and util > threshold:
        return max(1, math.floor(SHRINK * limit))
    return min(max_batch, max(limit + 1, math.floor(limit / SHRINK)))

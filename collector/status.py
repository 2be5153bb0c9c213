"""What the collector can and cannot read, said once per change rather than every tick."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

EventSink = Callable[[str, str], None]     # (kind, message) -> recorded in the store


@dataclass
class SourceStatus:
    """Remembers each source's last state so that transitions are reported once."""
    record_event: EventSink
    _down: dict[str, str] = field(default_factory=dict)

    def unavailable(self, source: str, reason: str) -> None:
        if self._down.get(source) == reason:
            return
        self._down[source] = reason
        log.warning("cannot read %s: %s; sampling the rest", source, reason)
        self.record_event("collector.source_unavailable", f"cannot read {source}: {reason}")

    def available(self, source: str) -> None:
        if self._down.pop(source, None) is not None:
            log.info("%s is readable again", source)
            self.record_event("collector.source_available", f"{source} is readable again")

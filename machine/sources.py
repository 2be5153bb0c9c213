"""The one error a reader of the machine raises when a source cannot be read here."""
from __future__ import annotations


class SourceUnavailable(Exception):
    """A data source cannot be read here; the message says what and why (and what would help)."""

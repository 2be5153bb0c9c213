"""argparse types the commands and the benches share: a bad value is one usage line, not a traceback."""
from __future__ import annotations

import argparse


def count(text: str) -> int:
    """A count (bytes, rounds, tokens, clients, threads): a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def port(text: str) -> int:
    """A TCP port: 0 (the system picks a free one) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, got {value}")
    return value

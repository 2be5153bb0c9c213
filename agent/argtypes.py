"""argparse types the commands and the benches share: a bad value is one usage line, not a traceback."""
from __future__ import annotations

import argparse
from pathlib import Path

MAX_THREADS = 256


def count(text: str) -> int:
    """A count (bytes, rounds, tokens, clients, threads): a whole number of at least 1."""
    value = _whole(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def counts(text: str) -> list[int]:
    """Comma-separated counts, e.g. "1,2,4"."""
    return [count(part) for part in text.split(",")]


def port(text: str) -> int:
    """A TCP port: 0 (the system picks a free one) to 65535."""
    return _within(_whole(text), 0, 65535, "a port")


def seed(text: str) -> int:
    """A random seed that torch and numpy both take: 0 to 2**63 - 1."""
    return _within(_whole(text), 0, 2 ** 63 - 1, "a seed")


def threads(text: str) -> int:
    """A thread count: 1 to MAX_THREADS (far above any useful count; the OS refuses threads long before 100,000)."""
    return _within(_whole(text), 1, MAX_THREADS, "a thread count")


def path(text: str) -> Path:
    """A file or directory path, never "": Path("") is ".", so `convert SRC ""` was told "the destination .
    already exists and is not empty"."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path: name a file or directory")
    return Path(text)


def refuse_empty_paths(parser: argparse.ArgumentParser) -> None:
    """Every argument of `parser` and its subcommands typed Path takes `path` instead: one place for every
    command's files and directories, the ones added later included."""
    for action in parser._actions:
        if action.type is Path:
            action.type = path
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                refuse_empty_paths(sub)


def on_off(text: str) -> bool:
    """A switch: on or off."""
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return text == "on"


def add_int8_activations(parser: argparse.ArgumentParser) -> None:
    """generate's and serve's --int8-activations, into `int8_activations` (a bool)."""
    parser.add_argument("--int8-activations", type=on_off, default=True, metavar="{on,off}",
                        help="int8 experts (and --dense int8's linears) of a bf16 model quantize their activations "
                             "too where an expert (a linear) has more "
                             "than 8 tokens (W8A8: prefill, large batches); off computes with the weights only "
                             "quantized, for a model whose activations hold outliers (default on)")


def add_dense(parser: argparse.ArgumentParser) -> None:
    """generate's and serve's --dense stored|int8, into `dense`."""
    from agent.model.dense_int8 import DENSE_MODES
    parser.add_argument("--dense", choices=DENSE_MODES, default="stored",
                        help="dense linears (attention projections, shared experts, LM head) as the store holds "
                             "them (stored, the default) or quantized to int8 as the model loads: half their bytes, "
                             "faster decode, answers moved ~10x more than by int8 experts (BENCHMARKS.md); "
                             "embeddings, norms and routers stay as stored")


def add_prefetch(parser: argparse.ArgumentParser, default: str | None) -> None:
    """generate's and serve's --prefetch on|off|auto and --no-prefetch, into `prefetch` (a mode or `default`)."""
    from agent.prefetch_gate import MODES
    parser.add_argument("--prefetch", choices=MODES, default=default,
                        help="lookahead prefetch reads: always (on), never (off: a pure demand-access run) or while "
                             "they pay (auto, the default; agent/prefetch_gate.py)")
    parser.add_argument("--no-prefetch", dest="prefetch", action="store_const", const="off",
                        help="the same as --prefetch off")


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def _within(value: int, lo: int, hi: int, what: str) -> int:
    if not lo <= value <= hi:
        raise argparse.ArgumentTypeError(f"{what} is {lo} to {hi}, got {value}")
    return value

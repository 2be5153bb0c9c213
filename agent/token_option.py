"""How a command is given the agent's token (serve, which demands it; warmup, which sends it): FLASHMOE_TOKEN
or --token-file FILE, which other users of the box cannot read, or --token, which they can (`ps` shows every
process's command line), taken with a warning."""
from __future__ import annotations

import argparse
import logging
import os
import stat
from pathlib import Path

log = logging.getLogger(__name__)

TOKEN_ENV = "FLASHMOE_TOKEN"
MAX_LINE = 4096   # bytes of --token-file read: a token is far shorter


class TokenError(ValueError):
    """The token file cannot be read; the message says what to fix."""


def add_token_arguments(p: argparse.ArgumentParser, what: str) -> None:
    given = p.add_mutually_exclusive_group()
    given.add_argument("--token", help=f"{what}; better, set {TOKEN_ENV} or pass --token-file: a command line is "
                                       f"visible to every user of the box")
    given.add_argument("--token-file", type=Path, metavar="FILE",
                       help=f"read the token (its first line) from FILE, readable by its owner only (instead of "
                            f"--token or {TOKEN_ENV})")


def token_from(args: argparse.Namespace) -> str | None:
    """The token --token, --token-file or FLASHMOE_TOKEN gives (in that order), or None."""
    if args.token:
        log.warning("the token was given with --token, which every user of this box can read in `ps`; set %s or "
                    "pass --token-file instead (a process's environment and a private file are its owner's only)",
                    TOKEN_ENV)
        return args.token
    if args.token_file is not None:
        return _read_token_file(args.token_file)
    return os.environ.get(TOKEN_ENV) or None


def _read_token_file(path: Path) -> str:
    try:
        with path.open("rb") as f:        # its first line only: a mistyped path may name a store of gigabytes
            head, mode = f.read(MAX_LINE), os.fstat(f.fileno()).st_mode
        token = head.split(b"\n", 1)[0].removesuffix(b"\r").decode()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "it is not text (not UTF-8)"
        raise TokenError(f"cannot read --token-file {path}: {reason}; give a file holding the token on its "
                         f"first line") from None
    if not token:
        raise TokenError(f"--token-file {path} holds no token on its first line; write the token there, e.g. "
                         f"`openssl rand -hex 16 > {path}`")
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        log.warning("--token-file %s is readable by other users of this box; `chmod 600 %s`", path, path)
    return token

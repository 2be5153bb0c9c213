"""Output files written whole or not at all, and checked before the work that fills them.

Each is written to a new `NAME.<random>.tmp` beside it and renamed over it: a reader never sees half a
file, a write that fails leaves nothing, not even the directories it made, and a file of the user's that
happens to be called like a temporary one is never written over or removed. A command checks its output can
be written before it starts (`check_writable`, with the room it will take where that is known), so a
bad path or a full disk is an error in a second, not after minutes of training or generating.
"""
from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable
from pathlib import Path

from store.database import missing_parents, remove_empty


def write_atomically(path: Path, write: Callable[[Path], object], what: str, flag: str,
                     errors: tuple[type[Exception], ...] = (), keep: bool = True,
                     ours: Callable[[Path], bool] | None = None) -> None:
    """`write(tmp)` then rename tmp to `path`; any OSError (or one of `errors`) is a ValueError that names
    `what` and `path` and asks for another `flag`, with nothing left behind. With `ours`, a file `path` already
    holds is replaced only if `ours(path)` (see check_replaceable)."""
    if ours is not None:
        check_replaceable(path, ours, what, flag)
    missing, tmp = missing_parents(path), None
    try:
        if path.is_dir():
            raise IsADirectoryError(21, "it is a directory")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = new_file_beside(path)
        write(tmp)
        tmp.replace(path) if keep else tmp.unlink()
    except (OSError, *errors) as e:
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.unlink()
        remove_empty(missing)
        reason = e.strerror if isinstance(e, OSError) and e.strerror else e
        raise ValueError(f"cannot write {what} {path}: {reason}; pass another {flag}") from None
    if not keep:
        remove_empty(missing)


def new_file_beside(path: Path) -> Path:
    """A new empty file `NAME.<random>.tmp` next to `path`, created exclusively (so it is ours to remove) with
    the mode a file written in place would have."""
    tmp = path.with_name(f"{path.name}.{secrets.token_hex(4)}.tmp")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    return tmp


def check_writable(path: Path, what: str, flag: str, size: int = 0,
                   ours: Callable[[Path], bool] | None = None) -> None:
    """Fail now, with the reason, if `write_atomically` could not write `path` of `size` bytes (written and
    removed: a full disk takes an empty file), or, with `ours`, would not replace it. Leaves nothing behind."""
    write_atomically(path, lambda tmp: tmp.write_bytes(bytes(size)), what, flag, keep=False, ours=ours)


def check_replaceable(path: Path, ours: Callable[[Path], bool], what: str, flag: str) -> None:
    """A file already at `path` is overwritten only if it is empty or `ours(path)` finds it is `what`: a mistyped
    path (a model's experts.bin, the SQLite store) must not be destroyed by an output written over it."""
    if path.is_file() and path.stat().st_size and not ours(path):
        raise ValueError(f"{flag} {path} exists and holds something other than {what} (it would be overwritten, "
                         f"so it is left as it is); pass another {flag}")

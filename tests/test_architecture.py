"""The rooms of ARCHITECTURE.md: a room imports only the rooms below it."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ALLOWED = {                       # room -> the rooms of ours it may import (ARCHITECTURE.md's table)
    "machine": set(),
    "access": set(),
    "store": {"machine"},
    "collector": {"machine", "store"},
    "agent": {"access", "machine", "store"},
    "dashboard": {"access", "store"},
}


def imported_rooms(path: Path) -> set[str]:
    """The top-level packages of ours that a module imports (absolute imports; ours use no others)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return {name.split(".")[0] for name in names} & (set(ALLOWED) | {"bench", "tests"})


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_a_room_imports_only_the_rooms_below_it(room):
    modules = sorted((ROOT / room).rglob("*.py"))
    assert modules, f"{room}/ has no modules"
    crossings = [f"{m.relative_to(ROOT)} imports {other}" for m in modules
                 for other in sorted(imported_rooms(m) - ALLOWED[room] - {room})]
    assert not crossings, "imports across ARCHITECTURE.md's walls:\n" + "\n".join(crossings)


def test_the_check_sees_an_import_across_a_wall(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\nfrom agent.experts import cache\nfrom store.db import Store\n")
    assert imported_rooms(module) == {"agent", "store"}

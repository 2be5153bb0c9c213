"""An empty path argument is refused as empty, by every command: Path("") is ".", the current directory."""
from __future__ import annotations

import argparse
import subprocess

import pytest

from agent import argtypes
from agent.cli import COMMANDS, build_parser, main
from agents import CLI

PATH_WORDS = {"FILE", "PATH", "DIR", "SRC_DIR", "DST_DIR"}            # metavars that name a path
PATH_DESTS = {"db", "pid_file", "model", "out", "store_path", "file"}


def arguments(command: str) -> list[argparse.Action]:
    sub = next(a for a in build_parser(command)._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]._actions


def test_convert_to_an_empty_destination_is_refused_as_empty(tmp_path):
    """It said "the destination . already exists and is not empty"."""
    done = subprocess.run([*CLI, "convert", str(tmp_path), ""], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().endswith("flashmoe-cli convert: error: argument DST_DIR: an empty path: name a file "
                                        "or directory"), done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_path_argument_refuses_an_empty_path(command, capsys):
    actions = arguments(command)
    named = [a for a in actions if a.metavar in PATH_WORDS or a.dest in PATH_DESTS]
    assert all(a.type is argtypes.path for a in named), [a.dest for a in named if a.type is not argtypes.path]
    positionals = [a for a in actions if not a.option_strings and a.nargs != argparse.REMAINDER]
    for action in (a for a in actions if a.type is argtypes.path):
        before = ["x"] * positionals.index(action) if action in positionals else action.option_strings[:1]
        with pytest.raises(SystemExit) as exit_:
            main([command, *before, ""])
        assert exit_.value.code == 2 and "an empty path" in capsys.readouterr().err, (command, action.dest)


def test_the_paths_of_each_command_are_found():
    """The check above reaches the commands' files and directories, not none of them."""
    found = {(c, a.dest) for c in COMMANDS for a in arguments(c) if a.type is argtypes.path}
    assert {("convert", "src"), ("convert", "dst"), ("collect", "db"), ("collect", "pid_file"), ("serve", "pid_file"),
            ("serve", "model"), ("simulate", "trace"), ("simulate", "db"), ("init-demo", "out"),
            ("train-policy", "trace"), ("serve", "token_file")} <= found, found

"""Every flashmoe-cli command's --help ends with a runnable example of that command (README's promise)."""
from __future__ import annotations

import pytest

from agent.cli import COMMANDS, main


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_help_has_an_example(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    usage, _, epilog = capsys.readouterr().out.partition("\n\n")
    assert exit_.value.code == 0 and f"flashmoe-cli {command} " in epilog, f"{command} --help has no example"

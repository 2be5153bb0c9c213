"""The Procfile `make demo` runs: every process finds the agent on the port the agent listens on, and
both ports can be moved (FLASHMOE_AGENT_PORT, FLASHMOE_DASHBOARD_PORT) when 8600 or 8501 is taken.
Each command is expanded by sh, as honcho runs it."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

PROCFILE = Path(__file__).resolve().parent.parent / "Procfile"


def expanded(env: dict[str, str]) -> dict[str, list[str]]:
    """Each process's command line as sh expands it under `env`."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FLASHMOE_")} | env
    lines = [line.split(":", 1) for line in PROCFILE.read_text().splitlines() if line.strip()]
    return {name: subprocess.run(["sh", "-c", f"printf '%s\\n' {command}"], env=clean, capture_output=True,
                                 text=True, check=True).stdout.split() for name, command in lines}


def after(words: list[str], flag: str) -> str:
    return words[words.index(flag) + 1]


MOVED = {"FLASHMOE_AGENT_PORT": "18621", "FLASHMOE_DASHBOARD_PORT": "18522"}


@pytest.mark.parametrize("env, agent, dashboard", [({}, "8600", "8501"), (MOVED, "18621", "18522")])
def test_every_process_finds_the_agent_on_its_port(env, agent, dashboard):
    procs = expanded(env)
    assert set(procs) == {"agent", "collector", "dashboard", "traffic"}
    assert procs["agent"][:5] == ["flashmoe-cli", "supervise", "--", "flashmoe-cli", "serve"]   # comes back if killed
    assert after(procs["agent"], "--port") == agent
    assert f"FLASHMOE_AGENT_URL=http://127.0.0.1:{agent}" in procs["dashboard"]
    assert after(procs["dashboard"], "--server.port") == dashboard
    assert after(procs["traffic"], "--agent-url") == f"http://127.0.0.1:{agent}"
    assert after(procs["collector"], "--pid-file") == after(procs["agent"], "--pid-file")

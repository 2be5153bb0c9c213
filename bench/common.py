"""What every benchmark writes beside its numbers: the machine it ran on, and its results file.

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # the repo, so `bench` imports
    from bench.common import machine, write_results
    write_results("codec", {"rows": rows, "machine": machine()})      # bench/results/codec.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

from agent.argtypes import count, counts  # noqa: F401  (the benches' count arguments)
from agent.experts.layout import EXPERTS
from agent.experts.reader import dio_alignment

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine(store: Path | None = None) -> dict[str, Any]:
    """CPU model, cores, RAM, kernel and Python; given the expert store a benchmark reads, also the
    filesystem it is on and the alignment O_DIRECT needs there."""
    facts: dict[str, Any] = {"cpu": _cpu_model(), "cores": os.cpu_count(),
                             "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                             "kernel": platform.release(), "python": platform.python_version(),
                             "load_avg": os.getloadavg()}  # the machine is shared: what else ran
    if store is not None:
        mem, off = dio_alignment(store / EXPERTS)
        facts |= {"filesystem": _filesystem(store), "dio_alignment": {"memory": mem, "offset": off}}
    return facts


def results_name(text: str) -> str:
    """A --results NAME: a file name in bench/results/, checked before the run rather than after it."""
    if not re.fullmatch(r"[\w.-]+", text) or text.startswith("."):
        raise argparse.ArgumentTypeError(f"expected a file name (letters, digits, '.', '-', '_'), got {text!r}")
    return text


def write_results(name: str, result: dict[str, Any]) -> Path:
    """Write `result` to bench/results/<name>.json and say where."""
    path = RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return path


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _filesystem(path: Path) -> str:
    """`<device> <type>` of the filesystem holding `path`, as `df -T` names them."""
    out = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True).stdout.splitlines()
    return " ".join(out[1].split()[:2]) if len(out) > 1 else "unknown"

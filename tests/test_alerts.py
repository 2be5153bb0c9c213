"""examples/alerts.yml and examples/prometheus.yml as a user loads them: Debian's promtool checks
their syntax and runs the rules' unit tests (examples/alerts.test.yml)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
PROMTOOL = "/usr/bin/promtool"


def promtool(*args: str, cwd: Path = EXAMPLES) -> subprocess.CompletedProcess:
    assert shutil.which(PROMTOOL), ("Debian's prometheus package (with promtool) is a test dependency "
                                    "(.ci/system-packages)")
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args", [("check", "rules", "alerts.yml"), ("check", "config", "prometheus.yml"),
                                  ("test", "rules", "alerts.test.yml")], ids=" ".join)
def test_promtool_accepts_the_examples(args):
    result = promtool(*args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_a_broken_rule_fails_its_unit_test(tmp_path):
    """The unit tests can fail: a thrash threshold raised fivefold no longer fires where it must."""
    rules = (EXAMPLES / "alerts.yml").read_text()
    assert rules.count("> 0.10") == 1
    (tmp_path / "alerts.yml").write_text(rules.replace("> 0.10", "> 0.50"))
    shutil.copy(EXAMPLES / "alerts.test.yml", tmp_path)
    result = promtool("test", "rules", "alerts.test.yml", cwd=tmp_path)
    assert result.returncode != 0
    assert "alertname: FlashMoEMemoryPressure" in result.stdout + result.stderr

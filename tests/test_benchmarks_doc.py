"""BENCHMARKS.md's figures trace to runs: every table's section names a committed bench/results JSON."""
from __future__ import annotations

import re

import pytest

from agents import ROOT

DOC = ROOT / "BENCHMARKS.md"
NAMED = re.compile(r"bench/results/([\w.-]+\.json)")


def sections() -> dict[str, str]:
    """Heading -> its text up to the next heading of any level (headings inside code fences ignored)."""
    out, heading, fenced = {}, "", False
    for line in DOC.read_text().splitlines():
        fenced ^= line.startswith("```")
        if line.startswith("#") and not fenced:
            heading = line.lstrip("#").strip()
            out[heading] = ""
        else:
            out[heading] = out.get(heading, "") + line + "\n"
    return out


def named_results() -> list[str]:
    return sorted(set(NAMED.findall(DOC.read_text())))


@pytest.mark.parametrize("name", named_results())
def test_every_results_file_the_doc_names_is_committed(name):
    assert (ROOT / "bench" / "results" / name).is_file()


def test_every_section_with_a_table_names_the_json_of_its_run():
    with_tables = {h: text for h, text in sections().items() if re.search(r"^\|[-| ]+\|$", text, re.M)}
    assert len(with_tables) > 10, "the doc's tables were not found"
    assert [h for h, text in with_tables.items() if not NAMED.search(text)] == []

"""`flashmoe-cli store stats|export|compact` through the real CLI entry point."""
import csv
import io
import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from agent.cli import main
from store.db import Store

T0 = 1_700_000_000.0


@pytest.fixture
def db(tmp_path):
    path = tmp_path / "flashmoe.db"
    with Store(path, chunk_points=50, autoflush_s=0) as store:
        for i in range(120):
            store.append("block.vda.util", T0 + i, (i % 4) / 4)
            store.append("psi.io.some_total_us", T0 + i, 10 * i)
        store.record_event(T0, "test", "hello")
    return path


def test_stats_json_counts_points_and_bytes(db, capsys):
    assert main(["store", "stats", "--db", str(db), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    by_name = {s["name"]: s for s in report["series"]}
    assert by_name["block.vda.util"]["points"] == 120 and by_name["block.vda.util"]["chunks"] == 3
    assert report["points"] == 240 and report["rows"]["events"] == 1
    assert report["bytes_per_point"] == pytest.approx(report["encoded_bytes"] / 240, abs=1e-3)


def test_stats_table_names_every_series(db, capsys):
    assert main(["store", "stats", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "block.vda.util" in out and "psi.io.some_total_us" in out and "all series" in out


def test_export_csv_and_json_lines_with_since(db, capsys):
    assert main(["store", "export", "--db", str(db), "--series", "psi.io.some_total_us", "--csv"]) == 0
    rows = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    assert rows[0] == ["t", "value"] and len(rows) == 121
    assert (float(rows[-1][0]), float(rows[-1][1])) == (T0 + 119, 1190.0)
    assert main(["store", "export", "--db", str(db), "--series", "block.vda.util",
                 "--since", str(T0 + 100)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [p["t"] for p in lines] == [T0 + i for i in range(100, 120)]
    assert main(["store", "export", "--db", str(db), "--series", "block.vda.util",
                 "--since", "2023-11-14T22:13:20+00:00", "--until", str(T0 + 1)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2          # T0 is 2023-11-14T22:13:20Z


def test_errors_name_the_problem(db, tmp_path, caplog):
    assert main(["store", "export", "--db", str(db), "--series", "nope"]) == 1
    assert "'nope' has no points" in caplog.text and "block.vda.util" in caplog.text
    assert main(["store", "stats", "--db", str(tmp_path / "missing.db")]) == 1
    assert "there is no store at" in caplog.text
    with pytest.raises(SystemExit):
        main(["store", "export", "--db", str(db), "--series", "x", "--since", "yesterday"])
    assert main(["store", "export", "--db", str(db), "--series", "block.vda.util", "--since", "5", "--until", "1"]) == 2
    assert "--since/--until: until (1.0) is before since (5.0)" in caplog.text     # was a ValueError traceback


@pytest.mark.parametrize("args", [["stats"], ["export", "--series", "x"], ["compact"]])
def test_a_directory_is_named_as_one_before_any_sqlite_word(tmp_path, caplog, args):
    assert main(["store", args[0], "--db", str(tmp_path), *args[1:]]) == 1
    (record,) = caplog.records
    assert record.getMessage().startswith(f"{tmp_path} is a directory") or "it is a directory" in record.getMessage()
    assert "disk I/O" not in caplog.text
    assert list(tmp_path.iterdir()) == []


def _no_tables(path):
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA user_version = 7")   # written to the header: an SQLite file, with no table


@pytest.mark.parametrize("make, what", [(Path.touch, "the file is empty"),
                                        (_no_tables, "the SQLite file holds no tables")])
def test_compact_refuses_a_file_that_stats_finds_no_store_in_and_leaves_it_as_it_was(tmp_path, caplog, make, what):
    """`touch x.db; store compact --db x.db` made a store of the empty file, in which `store stats` found none."""
    db = tmp_path / "x.db"
    make(db)
    before = db.read_bytes()
    assert main(["store", "stats", "--db", str(db)]) == 1 and "there is no store at" in caplog.text
    caplog.clear()
    assert main(["store", "compact", "--db", str(db)]) == 1
    (record,) = caplog.records
    assert record.getMessage() == f"there is no store at {db}: {what} (left as it is); check --db"
    assert db.read_bytes() == before and list(tmp_path.iterdir()) == [db]


@pytest.mark.parametrize("args", [["compact", "--retention-days", "-1"], ["compact", "--retention-days", "nan"],
                                  ["export", "--series", "block.vda.util", "--since", "nan"],
                                  ["export", "--series", "block.vda.util", "--until", "inf"]])
def test_numbers_that_would_delete_everything_or_match_nothing_are_refused(db, capsys, args):
    with pytest.raises(SystemExit) as exit_:
        main(["store", args[0], "--db", str(db), *args[1:]])
    assert exit_.value.code == 2 and args[-2] in capsys.readouterr().err
    assert main(["store", "stats", "--db", str(db), "--json"]) == 0  # nothing was deleted
    assert json.loads(capsys.readouterr().out)["points"] == 240


def test_compact_reports_what_it_did(db, capsys):
    assert main(["store", "compact", "--db", str(db), "--retention-days", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["chunks_deleted"] == 3 * 2  # all data is from 2023


def test_every_subcommand_documents_an_example(capsys):
    for sub in ("stats", "export", "compact"):
        with pytest.raises(SystemExit):
            main(["store", sub, "--help"])
        assert "example:\n  flashmoe-cli store " + sub in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["collect", "--help"])
    assert "example:\n  flashmoe-cli collect --db" in capsys.readouterr().out


@pytest.mark.parametrize("command", [["export", "--series", "block.vda.util"], ["stats"]])
def test_output_onto_a_full_disk_is_one_line_without_a_traceback(db, command):
    """`store export > file` on a full disk (/dev/full: every write is ENOSPC) ended in a traceback."""
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "agent.cli", "store", *command, "--db", str(db)],
                              stdout=full, stderr=subprocess.PIPE, text=True, timeout=60)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert ("store stopped: the disk is full (No space left on device) writing its output; what it wrote there "
            "is incomplete") in proc.stderr


@pytest.mark.parametrize("command", [["export", "--series", "block.vda.util"], ["stats"]])
def test_a_reader_that_stops_reading_ends_the_command_without_a_traceback(db, command):
    proc = subprocess.Popen([sys.executable, "-m", "agent.cli", "store", *command, "--db", str(db)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()                        # as `| head -1` does once it has its line
    stderr = proc.stderr.read()
    assert proc.wait(timeout=60) == 1
    assert stderr == ""

"""A device's name: one store per device (a writer for another device is refused), and names that fit a label."""
from __future__ import annotations

import argparse
import subprocess

import pytest

from agents import CLI, ROOT
from machine.identity import device_name
from store.db import Store
from store.errors import StoreError


def test_the_first_named_writer_claims_the_store_and_another_device_is_refused(tmp_path):
    path = tmp_path / "flashmoe.db"
    Store(path, device_name="edge-01").close()
    Store(path, device_name="edge-01").close()                 # the same device again
    Store(path).close()                                         # a writer that names no device
    with pytest.raises(StoreError) as err:
        Store(path, device_name="edge-02")
    assert "holds the telemetry of device 'edge-01', not 'edge-02'" in str(err.value)
    assert "\n" not in str(err.value)


def test_an_unnamed_store_is_claimed_by_its_first_named_writer(tmp_path):
    path = tmp_path / "flashmoe.db"
    Store(path).close()
    Store(path, device_name="edge-02").close()
    with pytest.raises(StoreError):
        Store(path, device_name="edge-01")


def test_the_collector_refuses_another_devices_store_in_one_line(tmp_path):
    path = tmp_path / "flashmoe.db"
    Store(path, device_name="edge-01").close()
    result = subprocess.run([*CLI, "collect", "--db", str(path), "--device-name", "edge-02", "--duration", "1"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "holds the telemetry of device 'edge-01'" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("name", ["", " edge", "edge 01", "-edge", "é", "a" * 64, "edge/01", "edge\n01"])
def test_a_name_that_would_not_fit_a_label_or_url_is_refused(name):
    with pytest.raises(argparse.ArgumentTypeError, match="is not a device name"):
        device_name(name)


@pytest.mark.parametrize("name", ["edge-01", "box.plant-a.lan", "A_1", "a" * 63])
def test_host_like_names_are_accepted(name):
    assert device_name(name) == name

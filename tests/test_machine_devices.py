"""Device discovery through pyudev on this machine's real devices, and real hot-plug events."""
import os
import time
from pathlib import Path

import pytest
import pyudev

from machine.devices import HotplugWatcher, block_devices, disk_holding, nvme_controllers


@pytest.fixture(scope="module")
def context():
    return pyudev.Context()


def test_block_devices_match_sysfs(context):
    disks = block_devices(context)
    expected = {p.name for p in Path("/sys/block").iterdir()
                if not p.name.startswith(("loop", "ram", "zram"))}
    assert {d.name for d in disks} == expected
    for disk in disks:
        sysfs = Path("/sys/block") / disk.name
        assert disk.size_bytes == int((sysfs / "size").read_text()) * 512
        assert disk.logical_block_size == int((sysfs / "queue/logical_block_size").read_text())
        assert f"{disk.major}:{disk.minor}" == (sysfs / "dev").read_text().strip()


def test_nvme_controllers_match_sysfs(context):
    names = {c.name for c in nvme_controllers(context)}
    sysfs = Path("/sys/class/nvme")
    assert names == ({p.name for p in sysfs.iterdir()} if sysfs.exists() else set())


def test_the_disk_holding_a_path_is_its_st_dev(context, tmp_path):
    disk = disk_holding(tmp_path, context)
    st_dev = os.stat(tmp_path).st_dev
    own = Path(f"/sys/dev/block/{os.major(st_dev)}:{os.minor(st_dev)}").resolve()
    expected = own.parent.name if (own / "partition").exists() else own.name
    assert disk.name == expected


def test_a_path_on_no_block_device_is_explained(context):
    with pytest.raises(ValueError, match="not a block device"):
        disk_holding("/proc/self", context)


def test_hotplug_events_are_noticed_without_blocking(context):
    watcher = HotplugWatcher(context)
    assert watcher.poll() == []                                   # returns at once when idle
    device = sorted(p.name for p in Path("/sys/block").iterdir())[0]
    Path(f"/sys/block/{device}/uevent").write_text("change")      # the kernel emits a real uevent
    deadline = time.monotonic() + 10
    seen = []
    while not any(e.name == device for e in seen) and time.monotonic() < deadline:
        seen += watcher.poll()
        time.sleep(0.02)
    assert any(e.name == device and e.action == "change" and e.subsystem == "block" for e in seen)


def test_a_path_on_a_partition_maps_to_its_whole_disk(context, tmp_path, monkeypatch):
    """This machine has no partitions (and loop devices get none here), so the partition is the
    one stand-in: pyudev answers the st_dev lookup with a partition of the real disk."""
    disk = block_devices(context)[0]
    real = pyudev.Devices.from_name(context, "block", disk.name)

    class Partition:
        device_type = "partition"

        def find_parent(self, subsystem, device_type=None):
            assert (subsystem, device_type) == ("block", "disk")
            return real

    monkeypatch.setattr(pyudev.Devices, "from_device_number", lambda *args: Partition())
    assert disk_holding(tmp_path, context) == disk

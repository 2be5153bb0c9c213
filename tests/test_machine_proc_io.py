"""machine.proc_io on this machine's own /proc: read_bytes, and the disks a process's files are on."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from machine import proc_io


def test_read_bytes_is_parsed_and_a_file_without_it_is_refused():
    assert proc_io.read_bytes(os.getpid()) >= 0
    assert proc_io.parse_read_bytes(b"rchar: 1\nread_bytes: 4096\nwrite_bytes: 0\n") == 4096
    with pytest.raises(ValueError, match="no read_bytes"):
        proc_io.parse_read_bytes(b"rchar: 1\n")


def test_a_file_open_for_reading_tells_its_disk_one_only_written_does_not(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 4096)
    disk = proc_io.disk_of(os.stat(path).st_dev)
    if disk is None:
        pytest.skip(f"{tmp_path} is on no block device")
    others = proc_io.reads_disk(os.getpid(), disk)      # what this process already has open there
    fd = os.open(path, os.O_WRONLY)
    try:
        assert proc_io.reads_disk(os.getpid(), disk) == others
    finally:
        os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert proc_io.reads_disk(os.getpid(), disk)
        assert proc_io.direct_io_disk(os.getpid()) is None
    finally:
        os.close(fd)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        assert proc_io.direct_io_disk(os.getpid()) == disk
    finally:
        os.close(fd)


def test_a_device_number_of_no_block_device_has_no_disk():
    assert proc_io.disk_of(os.makedev(0, 0)) is None


def test_a_name_a_process_gives_itself_is_read_printable_whatever_its_bytes():
    """comm is any bytes a process sets (prctl PR_SET_NAME): one not UTF-8 raised UnicodeDecodeError, which
    cost the collector its whole disk split for every tick such a process read the agent's disk, and terminal
    escapes reached `flashmoe-cli diagnose`'s output."""
    name = b"\xff\x1b[2J[x](//e)"       # 15 bytes, the kernel's most
    setter = ("import ctypes, sys; ctypes.CDLL(None).prctl(15, ctypes.c_char_p(bytes.fromhex(sys.argv[1])), 0, 0, 0); "
              "print('named', flush=True); sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", setter, name.hex()], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline() == b"named\n"
        assert proc_io.process_name(child.pid) == "\\xff\\x1b[2J[x](//e)"
    finally:
        child.communicate(b"")
    assert proc_io.process_name(child.pid) == "?"       # exited

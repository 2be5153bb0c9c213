"""machine.proc_io on this machine's own /proc: read_bytes and write_bytes, and the disks a process's
files (open or mapped) are on."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from machine import proc_io

MIB = 1 << 20


def test_io_bytes_are_parsed_and_a_file_without_them_is_refused():
    assert min(proc_io.io_bytes(os.getpid())) >= 0
    assert proc_io.parse_io(b"rchar: 1\nread_bytes: 4096\nwrite_bytes: 8192\n") == (4096, 8192)
    with pytest.raises(ValueError, match="no write_bytes"):
        proc_io.parse_io(b"rchar: 1\nread_bytes: 4096\n")


def disk_of_dir(path) -> str:
    disk = proc_io.disk_of(os.stat(path).st_dev)
    if disk is None:
        pytest.skip(f"{path} is on no block device")
    return disk


def test_a_file_open_for_reading_tells_its_disk_read_one_only_written_written(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 4096)
    disk = disk_of_dir(tmp_path)
    before = proc_io.use_of(os.getpid(), disk)      # what this process already has open there
    fd = os.open(path, os.O_WRONLY)
    try:
        assert proc_io.use_of(os.getpid(), disk) == (before.reads, True)
    finally:
        os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert proc_io.use_of(os.getpid(), disk) == (True, before.writes)
        assert proc_io.direct_io_disk(os.getpid()) is None
    finally:
        os.close(fd)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        assert proc_io.direct_io_disk(os.getpid()) == disk
    finally:
        os.close(fd)


# libc's mmap through ctypes: Python's mmap.mmap keeps a descriptor of its own (a dup), where safetensors'
# Rust memmap2, numpy's... do not; the test needs the mapping alone.
MAPPED = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                           ctypes.c_int, ctypes.c_int, ctypes.c_long]
PROT_READ, MAP_SHARED, MADV_DONTNEED, PAGE = 1, 1, 4, os.sysconf("SC_PAGE_SIZE")


def mapped(path):
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    address = libc.mmap(None, size, PROT_READ, MAP_SHARED, fd, 0)
    os.close(fd)                              # as safetensors does: only the mapping is left
    return (ctypes.c_char * size).from_address(address), address, size


def read_pages(pages):
    return sum(pages[i][0] for i in range(0, len(pages), PAGE))       # a page fault each: this process's reads
"""
MAPPED_READER = MAPPED + """
pages, _, _ = mapped(sys.argv[1])
print("mapped", flush=True)
sys.stdin.readline()
print("read", read_pages(pages), flush=True)
sys.stdin.readline()
"""


def test_a_process_reading_a_file_through_its_mapping_is_charged_the_reads_and_uses_its_disk(tmp_path):
    """A real reader through mmap page faults, its descriptor closed: read_bytes counts the faults' reads
    (the faulting task submits them), and the mapping tells its disk."""
    path, size = tmp_path / "weights.bin", 32 * MIB
    with open(path, "wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)    # out of the page cache: the faults read the disk
    disk = disk_of_dir(tmp_path)
    reader = subprocess.Popen([sys.executable, "-c", MAPPED_READER, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert reader.stdout.readline() == "mapped\n"
        assert proc_io.use_of(reader.pid, disk) == (True, False)
        before = proc_io.io_bytes(reader.pid)
        reader.stdin.write("\n")
        reader.stdin.flush()
        assert reader.stdout.readline().startswith("read ")
        assert proc_io.io_bytes(reader.pid).read - before.read >= 0.9 * size
    finally:
        reader.kill()
        reader.wait()


def test_a_program_and_its_libraries_mapped_are_no_use_of_their_disk(tmp_path):
    """A shell reaping readers is charged their bytes (proc(5)) but maps only code: not a reader. Its
    descriptors are pipes and /dev/null, so only its mappings could tell."""
    disk = disk_of_dir("/usr/bin")
    shell = subprocess.Popen(["sh", "-c", "echo ready; read line"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL)
    try:
        assert shell.stdout.readline() == b"ready\n"     # exec'd: no longer the fork of this process, its maps
        assert proc_io.use_of(shell.pid, disk) == (False, False)
    finally:
        shell.communicate(b"\n")


def test_a_shells_own_io_leaves_out_the_reader_it_reaped(tmp_path):
    """A shell is charged the read_bytes of a child it reaps (proc(5)); its threads' own I/O is not."""
    path = tmp_path / "data.bin"
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=1M", "count=16", "conv=fsync"], check=True,
                   capture_output=True)
    shell = subprocess.Popen(["sh", "-c", f"dd if={path} of=/dev/null bs=1M iflag=direct 2>/dev/null; echo reaped; "
                                          f"read line"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert shell.stdout.readline() == "reaped\n"
        assert proc_io.io_bytes(shell.pid).read >= 16 * MIB
        assert proc_io.own_io_bytes(shell.pid).read < MIB
    finally:
        shell.communicate("\n")


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

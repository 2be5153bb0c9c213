"""The three block readers and the slot pool, against a small store in the real layout."""
from __future__ import annotations

import errno
import os
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from agent.convert.store_writer import StoreShape, StoreWriter
from agent.experts.layout import ALIGN, EXPERTS, INDEX, Index, StoreError, crc32
from agent.experts.provider import InMemoryExperts, block_views
from agent.experts import reader as reader_module
from agent.experts.reader import BACKENDS, DirectReader, dio_alignment, open_reader
from agent.experts.slots import SlotPool

def write_store(path: Path, n_layers: int = 3, n_experts: int = 8, hidden: int = 64, intermediate: int = 40,
                top_k: int = 2, seed: int = 0) -> Path:
    """A store written by convert's StoreWriter: random float32 blocks (no dense weights: readers don't need them)."""
    rng = np.random.default_rng(seed)

    def fill(payload: memoryview) -> None:
        payload.cast("f")[:] = rng.standard_normal(len(payload) // 4, dtype=np.float32)

    with StoreWriter(path, StoreShape(n_layers, n_experts, hidden, intermediate, "float32", 4)) as writer:
        writer.write_config({"model_type": "olmoe", "num_experts_per_tok": top_k,
                             "num_experts": n_experts, "num_hidden_layers": n_layers})
        for _ in range(writer.n_blocks):
            writer.add_block(fill)
    return path


def fd_flags(fd: int) -> int:
    """The open flags the kernel holds for fd (octal in /proc/self/fdinfo)."""
    return int(Path(f"/proc/self/fdinfo/{fd}").read_text().split("flags:")[1].split()[0], 8)


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return write_store(tmp_path / "store")


def flip_byte(store: Path, layer: int, expert: int) -> None:
    index = Index.load(store / INDEX)
    with open(store / EXPERTS, "r+b") as f:
        f.seek(index.block(layer, expert).offset + 17)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.parametrize("size", [0, 1, 4095, 5 * 1024 + 1, 3 * 2**20 + 7])
def test_the_crc_is_zlibs_whole_and_in_parts(size):
    """Every store's checksums are zlib's CRC-32, the ones written before isal computed them included."""
    data = np.random.default_rng(size).bytes(size)
    assert crc32(data) == zlib.crc32(data) == crc32(data[size // 3:], crc32(data[:size // 3]))


def test_slot_pool_is_page_aligned_and_views_share_memory():
    pool = SlotPool(3, 2 * ALIGN)
    slots = [pool.acquire() for _ in range(3)]
    for slot in slots:
        assert pool.tensor(slot).data_ptr() % ALIGN == 0 and pool.tensor(slot).numel() == 2 * ALIGN
    pool.buffer(slots[1])[5] = 7
    assert pool.tensor(slots[1])[5].item() == 7 and pool.tensor(slots[0])[5].item() == 0
    with pytest.raises(IndexError):
        pool.acquire()


def test_slot_pool_grows_and_shrinks_only_free_slots():
    pool = SlotPool(2, ALIGN)
    held = pool.acquire()
    pool.grow(3)
    assert len(pool) == 5 and pool.free == 4
    with pytest.raises(ValueError, match="only 4 are free"):
        pool.shrink(5)
    pool.shrink(4)
    assert len(pool) == 1 and held in pool and pool.free == 0


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_slot_pool_memory_is_resident_up_front_and_returned_on_shrink():
    before = rss_bytes()
    pool = SlotPool(16, 2**20)
    allocated = rss_bytes()
    pool.shrink(12)
    assert allocated - before >= 15 * 2**20  # pre-faulted: no page faults on the read path
    assert allocated - rss_bytes() >= 11 * 2**20 and len(pool) == 4


def test_slot_size_must_be_page_multiple():
    with pytest.raises(ValueError, match="multiple of the page size"):
        SlotPool(1, 1000)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_loads_the_same_bytes_as_in_memory(store, backend):
    index = Index.load(store / INDEX)
    reference = InMemoryExperts(store)
    reader = open_reader(backend, store / EXPERTS, index)
    pool = SlotPool(1, index.slot_bytes)
    slot = pool.acquire()
    for b in index.blocks:
        data = reader.load(b, pool.buffer(slot) if reader.uses_slots else None)
        got = block_views(torch.from_numpy(data), index)
        for mine, ref in zip(got, reference.get(b.layer, b.expert)):
            assert torch.equal(mine, ref)
    reader.close()


def test_direct_reader_really_opens_with_o_direct(store):
    index = Index.load(store / INDEX)
    reader = DirectReader(store / EXPERTS, index)
    assert fd_flags(reader.fd) & os.O_DIRECT
    reader.close()


def test_a_filesystem_refusing_o_direct_suggests_the_buffered_backend(store, monkeypatch):
    def refuse(path, flags, *args):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(reader_module.os, "open", refuse)
    with pytest.raises(StoreError, match="refuses O_DIRECT; use --backend buffered"):
        DirectReader(store / EXPERTS, Index.load(store / INDEX))


def test_a_coarser_dio_alignment_than_the_store_is_refused(store, monkeypatch):
    monkeypatch.setattr(reader_module, "dio_alignment", lambda path: (ALIGN, 4 * ALIGN))
    with pytest.raises(StoreError, match="alignment of 16384 bytes .*aligned to 4096; use --backend buffered"):
        DirectReader(store / EXPERTS, Index.load(store / INDEX))


def test_dio_alignment_divides_the_store_alignment(store):
    mem, off = dio_alignment(store / EXPERTS)
    assert mem > 0 and off > 0 and ALIGN % off == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_bit_flip_is_caught_naming_layer_expert_and_file(store, backend):
    flip_byte(store, 2, 5)
    index = Index.load(store / INDEX)
    reader = open_reader(backend, store / EXPERTS, index)
    pool = SlotPool(1, index.slot_bytes)
    with pytest.raises(StoreError, match=r"layer 2 expert 5 .*experts\.bin"):
        reader.load(index.block(2, 5), pool.buffer(pool.acquire()) if reader.uses_slots else None)


def test_verify_off_skips_the_crc_check(store):
    flip_byte(store, 0, 1)
    index = Index.load(store / INDEX)
    reader = open_reader("buffered", store / EXPERTS, index, verify=False)
    pool = SlotPool(1, index.slot_bytes)
    data = reader.load(index.block(0, 1), pool.buffer(pool.acquire()))
    assert crc32(data) != index.block(0, 1).crc32


@pytest.mark.parametrize("backend", BACKENDS)
def test_truncated_file_is_a_short_read_error(store, backend):
    index = Index.load(store / INDEX)
    last = index.blocks[-1]
    os.truncate(store / EXPERTS, last.offset + index.nbytes // 2)
    reader = open_reader(backend, store / EXPERTS, index)
    pool = SlotPool(1, index.slot_bytes)
    with pytest.raises(StoreError, match=rf"layer {last.layer} expert {last.expert} is truncated"):
        reader.load(last, pool.buffer(pool.acquire()) if reader.uses_slots else None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_missing_expert_file_is_a_store_error(store, backend):
    (store / EXPERTS).unlink()
    with pytest.raises(StoreError, match=r"experts\.bin is missing"):
        open_reader(backend, store / EXPERTS, Index.load(store / INDEX))


def test_unknown_backend_lists_the_choices(store):
    with pytest.raises(ValueError, match="direct, buffered, mmap"):
        open_reader("bogus", store / EXPERTS, Index.load(store / INDEX))


def test_mmap_reader_reports_page_cache_residency(store):
    index = Index.load(store / INDEX)
    reader = open_reader("mmap", store / EXPERTS, index)
    block = index.block(1, 3)
    reader.load(block, None)  # the CRC check touched every page
    assert reader.resident_bytes(block) >= index.nbytes

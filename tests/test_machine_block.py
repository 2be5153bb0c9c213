"""iostat -x arithmetic over two /sys/block/*/stat readings, counter wrap and reset."""
import pytest

from collector import series
from machine import block

#          reads merged sectors rd_ms writes merged sectors wr_ms inflight io_ticks in_queue + discard/flush
BEFORE = "  1000   10   80000   500    2000   20   160000  4000   1   3000    4500   0 0 0 0 0 0"
AFTER = "   1100   10   96000   600    2050   25   176384  4400   2   3500    5700   0 0 0 0 0 0"


def test_rates_match_iostat_over_two_seconds():
    rates = block.block_rates(block.parse_stat(BEFORE, 10.0), block.parse_stat(AFTER, 12.0))
    assert rates.reads_per_s == 50.0                            # 100 reads / 2 s
    assert rates.writes_per_s == 25.0                           # 50 writes / 2 s
    assert rates.read_bytes_per_s == 16000 * 512 / 2            # sectors are 512 B
    assert rates.write_bytes_per_s == 16384 * 512 / 2
    assert rates.util == 0.25                                   # 500 ms busy of 2000 ms
    assert rates.r_await_s == pytest.approx(0.001)              # 100 ms / 100 reads
    assert rates.w_await_s == pytest.approx(0.008)              # 400 ms / 50 writes
    assert rates.avg_request_bytes == pytest.approx((16000 + 16384) * 512 / 150)
    assert rates.queue_depth == pytest.approx(0.6)              # 1200 ms in queue / 2000 ms


def test_an_idle_interval_gives_zeros_not_division_errors():
    rates = block.block_rates(block.parse_stat(BEFORE, 0.0), block.parse_stat(BEFORE, 1.0))
    assert vars(rates) == dict.fromkeys(vars(rates), 0.0)


def test_util_is_capped_at_one():
    busy = "1000 10 80000 500 2000 20 160000 4000 1 5000 4500"
    assert block.block_rates(block.parse_stat(BEFORE, 0.0), block.parse_stat(busy, 1.0)).util == 1.0


def test_a_32_bit_counter_wrap_counts_the_increase():
    assert block.counter_delta(2**32 - 10, 5) == 15
    before = block.parse_stat(f"{2**32 - 40} 0 0 0 0 0 0 0 0 0 0", 0.0)
    after = block.parse_stat("60 0 0 0 0 0 0 0 0 0 0", 1.0)
    assert block.block_rates(before, after).reads_per_s == 100.0


def test_a_reset_of_a_64_bit_counter_counts_from_zero():
    assert block.counter_delta(2**40, 7) == 7
    assert block.counter_delta(5, 9) == 4


def test_bad_input_is_named():
    with pytest.raises(ValueError, match=">= 11 fields, got 3"):
        block.parse_stat("1 2 3", 0.0)
    with pytest.raises(ValueError, match="time order"):
        block.block_rates(block.parse_stat(BEFORE, 1.0), block.parse_stat(AFTER, 1.0))


def test_reads_the_real_stat_files():
    from pathlib import Path
    device = sorted(p.name for p in Path("/sys/block").iterdir())[0]
    first = block.read_stat(device, 0.0)
    second = block.read_stat(device, 1.0)
    assert second.reads >= first.reads and second.io_ticks_ms >= first.io_ticks_ms
    out = series.block_series(device, block.block_rates(first, second))
    assert set(out) == {f"block.{device}.{m}" for m in (
        "reads_per_s", "writes_per_s", "read_bytes_per_s", "write_bytes_per_s", "util",
        "r_await_s", "w_await_s", "avg_request_bytes", "queue_depth")}

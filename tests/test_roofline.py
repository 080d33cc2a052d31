"""The roofline floor of benchmarks/roofline.py (no timing: rates are given) and the
command lines of benchmarks/run_all.py."""
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

import roofline  # noqa: E402
import run_all  # noqa: E402

MiB, GiB = 2 ** 20, 2 ** 30
# a machine whose caches move 80 GB/s and whose memory moves 20 GB/s
RATES = roofline.Rates(matmul_flops=200e9, matmul_by_size={512: 200e9},
                       bandwidth={1 * MiB: 80e9, 4 * MiB: 60e9, 64 * MiB: 20e9,
                                  1 * GiB: 22e9})


def test_bandwidth_at_reads_the_working_set():
    assert RATES.bandwidth_at(2 * MiB) == 80e9  # between 1 and 4 MiB: the 1 MiB reading
    assert RATES.bandwidth_at(4 * MiB) == 60e9
    assert RATES.bandwidth_at(100 * MiB) == 22e9  # never below a larger size's reading
    assert RATES.bandwidth_at(10 * GiB) == 22e9
    assert RATES.bandwidth_at(1024) == 80e9  # below the sweep: its smallest size


def test_floor_takes_the_larger_term():
    # a cache-resident client: 1 GFLOP (5 ms) against 0.16 GB at 80 GB/s (2 ms)
    f = roofline.floor(1e9, 0.16e9, 2 * MiB, RATES)
    assert f["bound"] == "flops" and f["floor_s"] == pytest.approx(5e-3)
    # the same bytes with a working set in memory: 8 ms at 20-22 GB/s
    f = roofline.floor(1e9, 0.16e9, 2 * GiB, RATES)
    assert f["bound"] == "bytes" and f["floor_s"] == pytest.approx(0.16e9 / 22e9)


def test_merge_keeps_the_larger_rates():
    other = roofline.Rates(100e9, {512: 100e9, 1024: 250e9}, {1 * MiB: 90e9})
    m = RATES.merge(other)
    assert m.matmul_flops == 250e9 and m.bandwidth[1 * MiB] == 90e9
    assert m.bandwidth[64 * MiB] == 20e9


@pytest.mark.parametrize("quick", [True, False])
def test_run_all_commands_name_existing_scripts(quick):
    for name in run_all.SUITE:
        cmd = run_all.command(name, quick, out=None, gpu=False)
        if cmd is not None:
            assert os.path.exists(cmd[1]), cmd

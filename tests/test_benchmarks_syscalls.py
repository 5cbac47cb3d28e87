"""python -m benchmarks.syscalls: perf's counts summed into the columns, and a
real measurement where perf may read the kernel's tracepoints."""

from __future__ import annotations

import shutil
import subprocess

import pytest


def test_perf_counts_are_summed_into_columns(tmp_path) -> None:
    from benchmarks.syscalls import counts

    out = tmp_path / "perf.csv"
    out.write_text("# started on a day\n\n"
                   "120,,raw_syscalls:sys_enter,506743,100.00,,\n"
                   "7,,syscalls:sys_enter_epoll_wait,506743,100.00,,\n"
                   "3,,syscalls:sys_enter_poll,506743,100.00,,\n"
                   "<not counted>,,syscalls:sys_enter_ppoll,0,0.00,,\n"
                   "11,,syscalls:sys_enter_write,506743,100.00,,\n"
                   "5,,context-switches,506743,100.00,,\n")
    assert counts(str(out)) == {"syscalls": 120, "waits": 10, "reads": 0, "writes": 11,
                                "switches": 5}


def _perf_reads_tracepoints() -> bool:
    if shutil.which("perf") is None:
        return False
    probe = subprocess.run(["perf", "stat", "-x", ",", "-e", "raw_syscalls:sys_enter", "true"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


@pytest.mark.timeout(60)
@pytest.mark.skipif(not _perf_reads_tracepoints(), reason="perf cannot read tracepoints here")
def test_a_pipelined_case_over_tcp_is_counted_per_role() -> None:
    from benchmarks.syscalls import measure

    table = measure("ours", "tcp", "pipelined", 2000, 20, 2, 2)
    assert set(table) == {"broker", "workers", "client", "all"}
    # every request crossed each role: each made system calls and used CPU
    for role in ("broker", "workers", "client"):
        assert table[role]["syscalls"] > 0 and table[role]["cpu_us"] > 0
    assert table["all"]["rate"] > 0

"""Where the test suite's CPU goes: a pytest plugin that times every test (setup, call and teardown) and reads the
machine's busy share over it from /proc/stat, so the processes, servers and cluster jobs a test starts count too.

    PYTHONPATH=benchmarks .venv/bin/python -m pytest -n 0 -p suite_cpu --suite-cpu-out suite_cpu.json

It prints a table per test file (wall minutes, CPU core-minutes = wall x busy share x cores) and the suite's floor
on this machine: its CPU core-minutes over the cores, the least wall time any number of pytest-xdist workers can
reach without cutting work. Run it in one process (`-n 0`) on an otherwise idle machine: a test's busy share is the
whole machine's, so tests run side by side, or anything else running, would be counted into each other.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path

import pytest


def _jiffies() -> tuple[int, int]:
    """(busy, total) CPU jiffies of the whole machine since boot (idle and iowait are not busy)."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    return sum(values) - values[3] - values[4], sum(values)


def pytest_addoption(parser):
    parser.addoption("--suite-cpu-out", default=None, help="suite_cpu: write the per-test records here (JSON)")


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    if (getattr(config.option, "numprocesses", None) or 0) > 0:
        raise pytest.UsageError("suite_cpu: run with -n 0: a test's busy share is the whole machine's")
    config._suite_cpu = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    busy0, total0 = _jiffies()
    start = time.monotonic()
    yield
    busy1, total1 = _jiffies()
    item.config._suite_cpu.append({"test": item.nodeid, "wall_s": time.monotonic() - start,
                                   "busy_share": (busy1 - busy0) / max(1, total1 - total0)})


def _group(nodeid: str) -> str:
    path = nodeid.split("::")[0]
    return "tests/unit" if path.startswith("tests/unit/") else ("recipes" if path.startswith("recipes/") else path)


def pytest_terminal_summary(terminalreporter, config):
    records = getattr(config, "_suite_cpu", None)
    if not records:
        return
    cores = os.cpu_count() or 1
    files = defaultdict(lambda: [0, 0.0, 0.0])
    for r in records:
        f = files[_group(r["test"])]
        f[0] += 1
        f[1] += r["wall_s"]
        f[2] += r["wall_s"] * r["busy_share"] * cores
    write = terminalreporter.write_line
    write(f"suite_cpu: {'tests':>5} {'wall min':>9} {'CPU core-min':>13}  file ({cores} cores)")
    for name, (n, wall, cpu) in sorted(files.items(), key=lambda kv: -kv[1][2]):
        write(f"suite_cpu: {n:5d} {wall / 60:9.1f} {cpu / 60:13.1f}  {name}")
    wall = sum(f[1] for f in files.values())
    cpu = sum(f[2] for f in files.values())
    write(f"suite_cpu: {len(records):5d} {wall / 60:9.1f} {cpu / 60:13.1f}  all; floor on {cores} cores "
          f"{cpu / cores / 60:.1f} min")
    out = config.getoption("--suite-cpu-out")
    if out:
        Path(out).write_text(json.dumps({"cores": cores, "tests": records}, indent=1))

"""What Python's cyclic garbage collector costs a training process at its start and at its exit, the two ends
`empo2 train` changes (`empo2.utils.pause_gc_for_startup`, the exit handler in `empo2/cli.py`).

Each case is a fresh interpreter that imports Lightning (and with it torch, transformers' model classes and
torchmetrics), alternated `--repeats` times; CPU seconds (user + system) as the OS counts them:
- collector on: Python's default;
- paused, then frozen: as `empo2 train` runs its start-up (the collector off, then the survivors frozen, and
  thawed at the command's end);
- and no collection during the exit: as `empo2 train` also tears down (the teardown's final collection runs).

    python benchmarks/startup_gc.py [out.json] [--repeats 5]

Writes JSON to the given path, or to benchmarks/results/startup_gc.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

PAUSED = "import gc\ngc.disable()\nimport lightning\ngc.freeze()\ngc.enable()\ngc.unfreeze()\n"
CASES = {
    "collector on": "import lightning\n",
    "paused, then frozen": PAUSED,
    "paused, then frozen; no collection during the exit": "import atexit, gc\natexit.register(gc.disable)\n" + PAUSED,
}
# the CPU the process used when its script ends, before the interpreter's teardown
REPORT = "import resource\nu = resource.getrusage(resource.RUSAGE_SELF)\nprint(u.ru_utime + u.ru_stime)\n"


def run(code: str) -> tuple[float, float]:
    """(CPU seconds at the script's end, CPU seconds of the whole process) of one fresh interpreter."""
    proc = subprocess.Popen([sys.executable, "-c", code + REPORT], stdout=subprocess.PIPE, text=True)
    at_end = float(proc.stdout.read())
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0, proc.returncode
    return at_end, usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=str(Path(__file__).parent / "results" / "startup_gc.json"))
    parser.add_argument("--repeats", type=int, default=5, help="fresh interpreters per case")
    args = parser.parse_args()
    runs = {name: [] for name in CASES}
    for _ in range(args.repeats):
        for name, code in CASES.items():
            runs[name].append(run(code))
    report = {name: {"start_cpu_s": statistics.mean(s for s, _ in r),
                     "exit_cpu_s": statistics.mean(t - s for s, t in r),
                     "total_cpu_s": statistics.mean(t for _, t in r), "repeats": len(r)} for name, r in runs.items()}
    base = report["collector on"]["total_cpu_s"]
    for name, r in report.items():
        print(f"{name:52s} start {r['start_cpu_s']:5.2f} s  exit {r['exit_cpu_s']:5.2f} s  "
              f"total {r['total_cpu_s']:5.2f} s  ({r['total_cpu_s'] / base:.2f}x)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

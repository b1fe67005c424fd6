"""benchmarks/gpu_smoke.py, the check for users with a CUDA GPU, as far as a machine without one can see it: its
help lists every check and the time budget, without a GPU it stops at once in one line, and a check that would
start after the budget is spent is recorded as skipped, not run."""

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_smoke.py"
CHECKS = ("hf_cuda", "vllm_start", "fsdp_master_weights", "vllm_tensor_parallel", "sleep_level2_sync", "engine_dtype",
          "engine_gap", "launcher_two_gpus")


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_the_help_lists_the_checks_and_the_budget():
    proc = _run("--help")
    assert proc.returncode == 0, proc.stderr
    for name in CHECKS:
        assert f"  {name} " in proc.stdout, name
    assert "--budget-s" in proc.stdout


def test_without_a_cuda_gpu_it_stops_at_once_in_one_line(tmp_path):
    """No model, engine or report: one line on stderr, exit status 2."""
    start = time.monotonic()
    proc = _run("--out", str(tmp_path / "report.json"), CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and proc.stderr.startswith("gpu_smoke.py needs a CUDA GPU: torch ")
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "report.json").exists()
    assert time.monotonic() - start < 60


def test_a_check_after_the_budget_is_skipped_not_run(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("gpu_smoke", SCRIPT)
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    ran = []
    smoke.check("in_time")(lambda: ran.append("in_time"))
    monkeypatch.setattr(smoke, "DEADLINE", time.monotonic() - 1)
    smoke.check("late")(lambda: ran.append("late"))
    assert ran == ["in_time"]
    assert [(r["check"], r["status"]) for r in smoke.RESULTS] == [("in_time", "PASS"), ("late", "SKIP")]
    assert smoke.RESULTS[1]["reason"] == "the --budget-s budget was spent"

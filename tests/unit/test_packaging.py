import re
import tomllib
from pathlib import Path

import yaml
from packaging.requirements import Requirement

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
    assert sorted(map(_norm, pip)) == sorted(map(_norm, deps))


def test_ranges_admit_vllm_pins():
    # vLLM pins torch==2.14.0 and transformers>=5.16.1,<5.21: our ranges must contain those versions.
    deps = dict(map(_norm, tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]))
    from packaging.specifiers import SpecifierSet

    assert SpecifierSet(deps["torch"]).contains("2.14.0") and SpecifierSet(deps["torch"]).contains("2.13.0")
    assert SpecifierSet(deps["transformers"]).contains("5.16.1")
    assert not SpecifierSet(deps["transformers"]).contains("5.21.0")


def test_make_demo_runs_a_valid_config_with_the_shipped_prior():
    """`make demo` must work on a fresh machine: its overrides compose and validate, and its policy is shipped
    (nothing is built or downloaded)."""
    from empo2.config import load_config
    from empo2.models import preset_status

    line = next(ln for ln in (ROOT / "Makefile").read_text().splitlines() if "/empo2 train" in ln)
    cfg = load_config(line.split("empo2 train", 1)[1].split())
    assert (cfg.model.name, cfg.algo.name, cfg.memory.enabled) == ("minisci-tips-signed", "empo2", True)
    # one tip per prompt, the best-scoring one: the setting in which the memory is live in training
    # (reports/headline_minisci_tips_top1)
    assert (cfg.memory.top_k, cfg.memory.rank_by) == (1, "score")
    assert cfg.trainer.val_before_train and cfg.trainer.val_train  # the report shows before and after
    status = {name: s for name, s, _ in preset_status()}
    assert status[cfg.model.name] == "available (shipped)"

"""Runs recorded before a change of layout or names, reproduced after it: same seed, same numbers, exactly.

Each file in tests/data/preserved/*.json holds the overrides of one short fixed-seed run and the metrics its
`summary.json` had (final metrics and the per-iteration history) when it was recorded. Timings (`time/*`) are left
out: they are the only values two runs at one seed do not share. `python -m tests.integration.test_preserved NAME`
records one again, for a change that is meant to move the numbers (and says so in its commit).

tests/data/preserved/legacy/ is what an earlier layout left on disk: `empo2 grid grid.yaml` run there (one preset, one
seed, the tiny model, two iterations), its run folder (saved config, summary.json, checkpoint, tip memory) and its
MLflow store. The tests below work on a copy of it, as a user would on their own outputs/.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from empo2.config import current_metric, load_config
from empo2.workflows.train import train

PRESERVED = Path(__file__).resolve().parents[1] / "data" / "preserved"

# MiniSci with the shipped prior, the two presets the paper compares, 2 iterations of 1 instance x 4 rollouts
SMALL = ["model=minisci_tips_signed", "logger=none", "seed=7", "trainer.iterations=2", "rollout.tasks_per_batch=1",
         "rollout.group_size=4", "env.train_variations=1", "env.val_variations=2", "trainer.val_every=2",
         "trainer.ckpt_every=2", "trainer.val_before_train=false", "trainer.val_train=false"]
RUNS = {
    "empo2_minisci_tips": ["experiment=empo2_paper_minisci_tips", *SMALL],
    "grpo_minisci_tips": ["experiment=grpo_minisci_tips", *SMALL],
    "empo2_minisci_tips_vllm": ["experiment=empo2_paper_minisci_tips", *SMALL, "engine=vllm",
                                "engine.kv_cache_gib=0.25", "engine.max_model_len=4096"],
}


def _numbers(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith("time/")}


def run(name: str, root: Path) -> dict:
    """The recorded part of one run's summary.json."""
    summary = train(load_config([*RUNS[name], f"run_root={root}", f"run_name={name}"]))
    saved = json.loads(Path(summary["summary_path"]).read_text())
    return {"overrides": RUNS[name], "metrics": _numbers(saved["metrics"]),
            "history": [_numbers(h) for h in saved["history"]]}


@pytest.mark.parametrize("name", [
    "empo2_minisci_tips", "grpo_minisci_tips",
    pytest.param("empo2_minisci_tips_vllm", marks=[pytest.mark.needs("vllm"), pytest.mark.slow]),
])
def test_a_recorded_run_is_reproduced_exactly(name, tmp_path):
    recorded = json.loads((PRESERVED / f"{name}.json").read_text())
    assert recorded["overrides"] == RUNS[name], "the run's overrides changed: record it again, on purpose"
    got = run(name, tmp_path)

    def renamed(metrics: dict) -> dict:  # the names a run logs today (the records keep those they were made with)
        return {current_metric(k): v for k, v in metrics.items()}

    assert got["metrics"] == renamed(recorded["metrics"])
    assert got["history"] == [renamed(h) for h in recorded["history"]]


LEGACY = PRESERVED / "legacy"
LEGACY_RUN = "outputs/legacy/empo2_paper_minisci-s0"


@pytest.fixture
def legacy(tmp_path) -> Path:
    """A copy of the old grid folder (the copy keeps last.ckpt a link, as the run left it)."""
    shutil.copytree(LEGACY, tmp_path / "legacy", symlinks=True)
    return tmp_path / "legacy"


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "empo2.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def test_an_old_grid_still_resumes(legacy):
    # its finished run is recognised as finished under the grid's config, not refused as another config's
    out = _cli(legacy, "grid", "grid.yaml").stdout
    assert "1 runs, 1 already finished, 0 to run" in out


def test_compare_reads_the_old_grid(legacy):
    _cli(legacy, "compare", "--experiment", "legacy", "--run-root", "outputs", "--out", "cmp")
    table = (legacy / "cmp" / "compare.md").read_text()
    assert "| empo2_paper_minisci | 1 |" in table


@pytest.mark.slow
def test_an_old_run_folder_still_evaluates(legacy):
    # `empo2 eval` merges the run's saved config into today's schema
    _cli(legacy, "eval", f"ckpt={LEGACY_RUN}", "memory=off", "variations=1", "rollouts=1", "logger.name=none",
         "out=ev")
    result = json.loads((legacy / "ev" / "eval_test.json").read_text())
    assert result, "the evaluation wrote no scores"


@pytest.mark.slow
def test_an_old_checkpoint_still_resumes(legacy):
    grid = yaml.safe_load((LEGACY / "grid.yaml").read_text())
    before = json.loads((legacy / LEGACY_RUN / "summary.json").read_text())["history"]
    out = _cli(legacy, "train", f"experiment={grid['presets'][0]}", *grid["overrides"], "seed=0",
               "run_name=legacy/empo2_paper_minisci-s0", "resume=auto", "logger=none", "trainer.iterations=3").stdout
    assert "resuming from" in out
    after = json.loads((legacy / LEGACY_RUN / "summary.json").read_text())["history"]
    # the old iterations are kept as they were (under today's metric names), and the third one ran on top of them
    assert [h["iteration"] for h in after] == [0, 0, 1, 1, 2, 2]
    assert [_numbers(h) for h in after[:4]] == [{current_metric(k): v for k, v in _numbers(h).items()} for h in before]


if __name__ == "__main__":
    import tempfile

    import torch

    torch.set_num_threads(1)  # as tests/conftest.py sets it for the test that reruns it
    for name in sys.argv[1:] or RUNS:
        with tempfile.TemporaryDirectory() as tmp:
            (PRESERVED / f"{name}.json").write_text(json.dumps(run(name, Path(tmp)), indent=1, sort_keys=True) + "\n")
        print(f"recorded {PRESERVED / f'{name}.json'}")

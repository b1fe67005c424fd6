"""The research workflows end to end, through the `empo2` command: an ablation grid, an Optuna sweep,
the MLflow comparison, evaluation and memory-only adaptation. Real worker processes, real MLflow
(sqlite), real Optuna storage (sqlite), real Lightning and the tiny model."""

import csv
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import optuna
import pytest
from mlflow.tracking import MlflowClient

from empo2.algo.stats import T_SEEDS, TWO_LEVEL, t_interval, two_level_bootstrap
from empo2.config import ConfigError, load_config
from empo2.config.experiments import PROJECT_DIR
from empo2.envs import get_catalogue
from empo2.workflows.compare import run_memory_gain
from empo2.workflows.evaluate import adapt, resolve_checkpoint, run_config
from empo2.workflows.grid import plan_grid, run_grid
from empo2.workflows.sweep import load_sweep, run_sweep
from empo2.workflows.train import train
from tests.slurm import JOBS, slurm_cluster  # noqa: F401 (the `slurm` fixture)

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

# tests/integration/test_training.py's FAST budget, tracked in MLflow (no logger=none)
FAST = ["model=tiny", "trainer.iterations=2", "trainer.mini_batch_size=4", "trainer.micro_batch_size=2",
        "trainer.lr=1e-3", "trainer.val_every=1", "trainer.ckpt_every=1", "rollout.tasks_per_batch=2",
        "rollout.group_size=2", "rollout.max_new_tokens=6", "rollout.tip_max_new_tokens=12",
        "rollout.max_prompt_tokens=384", "env.max_steps=3", "env.val_variations=1"]
GRID_PRESETS = ["empo2_official_minisci", "grpo_minisci"]
# final metrics that differ between seeds and presets even for a random tiny model
COMPARED = ["rollout/return", "intrinsic/mean_reward", "memory/size", "val/score_nomem"]


def empo2(*args, timeout=600):
    proc = subprocess.run([sys.executable, "-m", "empo2.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true"))
    return proc


def _runs(uri, experiment):
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    return client.search_runs([exp.experiment_id]) if exp else []


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    """A 2 presets x 2 seeds grid, run once by the command with 2 worker processes."""
    root = tmp_path_factory.mktemp("grid")
    path = root / "mini.yaml"
    path.write_text(json.dumps({"name": "mini", "mlflow_experiment": "mini-grid", "presets": GRID_PRESETS,
                                "overrides": FAST}))
    proc = empo2("grid", path, "--seeds", 2, "--workers", 2, f"run_root={root / 'runs'}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {"file": path, "root": root / "runs", "uri": f"sqlite:///{root / 'runs' / 'mlflow.db'}",
            "stdout": proc.stdout}


@pytest.mark.slow  # reads the module's grid: four training runs
def test_grid_runs_every_preset_and_seed_into_one_tagged_experiment(grid):
    runs = _runs(grid["uri"], "mini-grid")
    assert len(runs) == 4 and {r.info.status for r in runs} == {"FINISHED"}
    tags = sorted((r.data.tags["preset"], r.data.tags["seed"], r.data.tags["grid"]) for r in runs)
    assert tags == sorted((p, str(s), "mini") for p in GRID_PRESETS for s in (0, 1))
    for r in runs:
        summary = json.loads((grid["root"] / "mini" / f"{r.data.tags['preset']}-s{r.data.tags['seed']}"
                              / "summary.json").read_text())
        assert summary["mlflow_run_id"] == r.info.run_id
        assert summary["config"]["seed"] == int(r.data.tags["seed"])
        assert summary["config"]["experiment"] == r.data.tags["preset"]


@pytest.mark.slow  # reads the module's grid: four training runs
def test_a_second_grid_invocation_skips_every_finished_run(grid):
    summaries = sorted(grid["root"].glob("mini/*/summary.json"))
    stamps = [p.stat().st_mtime_ns for p in summaries]
    proc = empo2("grid", grid["file"], "--seeds", 2, "--workers", 2, f"run_root={grid['root']}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 runs, 4 already finished, 0 to run" in proc.stdout
    assert "started" not in proc.stdout
    assert [p.stat().st_mtime_ns for p in summaries] == stamps
    assert len(_runs(grid["uri"], "mini-grid")) == 4


@pytest.mark.slow
def test_the_grid_submitted_to_slurm_ends_with_the_summaries_of_the_local_workers(grid, slurm, tmp_path):
    """The same grid file as one SLURM job per run (docs/cluster.md): the same metrics and config."""
    root = tmp_path / "runs"
    args = ["grid", grid["file"], "--seeds", 2, *JOBS, f"run_root={root}"]
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", **slurm.env}
    proc = subprocess.run([sys.executable, "-m", "empo2.cli", *map(str, args), "--launcher", "slurm"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    jobs = set()
    for preset in GRID_PRESETS:
        for seed in (0, 1):
            name = f"mini/{preset}-s{seed}"
            a = json.loads((root / name / "summary.json").read_text())
            b = json.loads((grid["root"] / name / "summary.json").read_text())
            for key in COMPARED:
                assert a["metrics"][key] == pytest.approx(b["metrics"][key], rel=1e-5), (name, key)
            assert a["config"] == {**b["config"], "run_root": str(root)}
            job = (root / name / "slurm_job").read_text().strip()
            jobs.add(job)
            # one line when the job is submitted and one when it ends, both with its id
            assert f"{preset} seed {seed}: SLURM job {job} (log " in proc.stdout
            assert f"{preset} seed {seed}: finished (SLURM job {job})" in proc.stdout
    assert len(jobs) == 4
    status = subprocess.run([sys.executable, "-m", "empo2.cli", *map(str, args), "--status"], capture_output=True,
                            text=True, timeout=300, env=env)
    assert status.returncode == 0 and status.stdout.count(": finished (SLURM job ") == 4, status.stdout


@pytest.mark.slow  # reads the module's grid: four training runs
def test_the_grid_refuses_to_skip_a_run_made_with_another_config(grid):
    with pytest.raises(ConfigError, match=r"trainer\.lr=0\.001 \(this grid wants 0\.002\)"):
        run_grid(grid["file"], seeds=2, overrides=[f"run_root={grid['root']}", "trainer.lr=2e-3"])


@pytest.mark.slow  # reads the module's grid: four training runs
def test_compare_table_and_curves_match_the_runs_summaries(grid):
    out = grid["root"] / "cmp"
    proc = empo2("compare", "--experiment", "mini-grid", "--run-root", grid["root"], "--out", out,
                 "--metrics", ",".join(COMPARED), "--x", "train/env_steps")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summaries = {p: [json.loads((grid["root"] / "mini" / f"{p}-s{s}" / "summary.json").read_text())
                     for s in (0, 1)] for p in GRID_PRESETS}
    with open(out / "compare.csv") as f:
        rows = {r["preset"]: r for r in csv.DictReader(f)}
    assert set(rows) == set(GRID_PRESETS)
    for preset, runs in summaries.items():
        assert rows[preset]["runs"] == "2"
        for m in COMPARED:
            values = [x["metrics"][m] for x in runs]
            assert float(rows[preset][f"{m} mean"]) == pytest.approx(np.mean(values), abs=1e-12)
            assert float(rows[preset][f"{m} std"]) == pytest.approx(np.std(values, ddof=1), abs=1e-12)
            # validation logs each instance's score beside the mean: there seeds, then instances are resampled
            units = [[v for k, v in sorted(x["metrics"].items()) if k.startswith(f"{m}/")] for x in runs]
            _, low, high = two_level_bootstrap(units) if all(units) else t_interval(values)
            assert (float(rows[preset][f"{m} ci95_low"]), float(rows[preset][f"{m} ci95_high"])) == \
                pytest.approx((low, high), abs=1e-12)
            assert rows[preset][f"{m} ci_method"] == (TWO_LEVEL if m == "val/score_nomem" else T_SEEDS)
            assert all(units) == (m == "val/score_nomem")
        # what the tips add like for like over a run (read back from MLflow's histories) as the run's own
        # closing report takes it from its summary
        gains = [run_memory_gain(x["history"]) for x in runs]
        cell = rows[preset].get("rollout/memory_gain (run) mean", "")
        if all(gains):
            assert float(cell) == pytest.approx(np.mean([g for g, _ in gains]), abs=1e-9)
        elif not any(gains):
            assert cell in ("", "nan")
    assert any(float(rows[p][f"{m} std"]) > 0 for p in GRID_PRESETS for m in COMPARED), "seeds should differ"
    table = (out / "compare.md").read_text()
    assert all(f"| {p} | 2 |" in table for p in GRID_PRESETS)
    assert f"Intervals: {T_SEEDS} (rollout/return, intrinsic/mean_reward, memory/size); {TWO_LEVEL} (val/score_nomem)" \
        in table
    # every run's own values beside the table, from which each interval is recomputed
    with open(out / "runs.csv") as f:
        per_run = list(csv.DictReader(f))
    assert [(r["preset"], r["seed"]) for r in per_run] == [(p, str(s)) for p in sorted(GRID_PRESETS) for s in (0, 1)]
    for r in per_run:
        assert r["run_name"] == f"{r['preset']}-s{r['seed']}"
        for m in COMPARED:
            assert float(r[m]) == summaries[r["preset"]][int(r["seed"])]["metrics"][m]
    for m in COMPARED:
        png = out / f"curve_{m.replace('/', '_')}.png"
        assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow  # reads the module's grid: four training runs
def test_compare_pairs_each_preset_with_the_baseline_seed_by_seed(grid):
    out = grid["root"] / "cmp_paired"
    proc = empo2("compare", "--experiment", "mini-grid", "--run-root", grid["root"], "--out", out,
                 "--metrics", ",".join(COMPARED), "--baseline", "grpo_minisci")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "minus grpo_minisci's, paired by seed" in proc.stdout
    summaries = {p: {s: json.loads((grid["root"] / "mini" / f"{p}-s{s}" / "summary.json").read_text())
                     for s in (0, 1)} for p in GRID_PRESETS}
    with open(out / "paired.csv") as f:
        rows = {r["preset"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"empo2_official_minisci"}  # the baseline is not paired with itself
    for m in COMPARED:
        diffs = [summaries["empo2_official_minisci"][s]["metrics"][m] - summaries["grpo_minisci"][s]["metrics"][m]
                 for s in (0, 1)]
        mean, low, high = t_interval(diffs)
        if m == "val/score_nomem":  # per seed, the per-instance differences
            per_instance = [[v - summaries["grpo_minisci"][s]["metrics"][k] for k, v in
                             sorted(summaries["empo2_official_minisci"][s]["metrics"].items()) if k.startswith(f"{m}/")]
                            for s in (0, 1)]
            mean, low, high = two_level_bootstrap(per_instance)
        row = rows["empo2_official_minisci"]
        assert [float(row[f"{m} {k}"]) for k in ("diff", "ci95_low", "ci95_high", "pairs")] == \
            pytest.approx([mean, low, high, 2], abs=1e-9)
    assert row["val/score_nomem ci_method"] == TWO_LEVEL and row["rollout/return ci_method"] == T_SEEDS
    bad = empo2("compare", "--experiment", "mini-grid", "--run-root", grid["root"], "--out", out,
                "--baseline", "grpo")
    assert bad.returncode != 0 and "--baseline 'grpo' is not a group" in bad.stderr and "grpo_minisci" in bad.stderr


@pytest.mark.slow  # reads the module's grid: four training runs
def test_eval_scores_a_checkpoint_per_task_with_and_without_memory(grid):
    run_dir = grid["root"] / "mini" / "empo2_official_minisci-s0"
    out = grid["root"] / "eval"
    proc = empo2("eval", f"ckpt={run_dir}", "memory=both", "split=test", "variations=1", f"out={out}",
                 "rollout.val_temperature=0.7")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "eval_test.json").read_text())
    assert report["config"]["rollout"]["val_temperature"] == 0.7  # the override on top of the run's config
    assert report["config"]["model"]["name"] == "tiny"  # the rest is the run's own config
    tasks = get_catalogue("minisci").tasks()  # the run trained on all in-distribution tasks
    for mode in ("nomem", "mem"):
        res = report["modes"][mode]
        assert sorted(res["per_task"]) == sorted(tasks) and res["episodes"] == len(tasks)
        assert all(0 <= t["score"] <= 100 and 0 <= t["success"] <= 1 for t in res["per_task"].values())
    table = (out / "eval_test.md").read_text()
    assert "score (nomem)" in table and "success (mem)" in table and "**all**" in table
    assert table.startswith("| task | episodes |") and f"| **all** | {len(tasks)} |" in table


@pytest.mark.slow  # reads the module's grid: four training runs
def test_adapt_accumulates_tips_over_trials_without_training(grid):
    ckpt = resolve_checkpoint(str(grid["root"] / "mini" / "grpo_minisci-s0"))  # a run trained without memory
    cfg = run_config(ckpt, ["memory.min_sim=-1"])  # every stored tip of the variation is retrieved
    out = grid["root"] / "adapt"
    report = adapt(cfg, ckpt, trials=3, variations=1, out=out)
    trials = report["trials"]
    assert [t["trial"] for t in trials] == [1, 2, 3]
    assert report["tasks"] == ["change-state"]  # MiniSci's held-out task
    assert trials[0]["tips_retrieved"] == 0 and trials[0]["memory_size"] > 0
    assert 0 < trials[1]["tips_retrieved"] < trials[2]["tips_retrieved"]
    assert trials[0]["memory_size"] < trials[1]["memory_size"] < trials[2]["memory_size"]
    saved = json.loads((out / "adapt.json").read_text())
    assert saved["trials"] == json.loads(json.dumps(trials))
    assert (out / "adapt_curve.png").read_bytes()[:4] == b"\x89PNG"
    lines = (out / "adapt.md").read_text().splitlines()
    assert lines[0].startswith("| trial | episodes |") and lines[-1].startswith(f"| 3 | {trials[2]['episodes']} |")


SWEEP = {
    "study": "tiny-sweep", "mlflow_experiment": "tiny-sweep", "preset": "grpo_minisci",
    "overrides": [o for o in FAST if not o.startswith("trainer.iterations")] + ["trainer.iterations=1"],
    # at iteration 0 every trial plays the same episodes, so the return differs only through beta
    "metric": "rollout/return", "direction": "maximize", "n_trials": 4, "seed": 0,
    # aggressive: judged from the first validation on, as soon as two trials have completed
    "pruner": {"type": "median", "n_startup_trials": 2, "n_warmup_steps": 0},
    "space": {"algo.beta_start": {"type": "float", "low": 0.0, "high": 1.0},
              "algo.q": {"type": "float", "low": 0.0, "high": 1.0}},
    # trials 0 and 1 complete whatever the order; the last trial then meets the median of two
    # higher-beta trials and is pruned
    "enqueue": [{"algo.beta_start": 0.8, "algo.q": 0.2}, {"algo.beta_start": 1.0, "algo.q": 0.8},
                {"algo.beta_start": 0.0, "algo.q": 0.5}, {"algo.beta_start": 0.0, "algo.q": 0.5}],
}


@pytest.mark.slow
def test_sweep_with_two_workers_prunes_nests_and_writes_a_usable_best_file(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text(json.dumps(SWEEP))
    root = tmp_path / "runs"
    proc = empo2("sweep", path, "--workers", 2, f"run_root={root}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    study = optuna.load_study(study_name="tiny-sweep", storage=f"sqlite:///{root / 'optuna.db'}")
    states = [t.state for t in study.trials]
    assert len(states) == 4 and optuna.trial.TrialState.PRUNED in states
    assert states[:2] == [optuna.trial.TrialState.COMPLETE] * 2
    pruned = [t for t in study.trials if t.state == optuna.trial.TrialState.PRUNED]
    assert all(t.params["algo.beta_start"] == 0.0 and t.intermediate_values for t in pruned)
    assert study.best_trial.number == 1

    uri = f"sqlite:///{root / 'mlflow.db'}"
    runs = _runs(uri, "tiny-sweep")
    parent = [r for r in runs if r.data.tags.get("empo2.role") == "study"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId")]
    assert len(parent) == 1 and len(children) == 4
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parent[0].info.run_id}
    assert sorted(r.data.tags["optuna.state"] for r in children) == sorted(s.name for s in states)

    best = root / "tiny-sweep" / "best.yaml"
    assert "- /experiment/grpo_minisci" in best.read_text()  # a Hydra preset built on the sweep's
    summary = train(load_config([f"experiment={best}", f"run_root={root}", "run_name=best", "logger=none"]))
    assert (summary["config"]["algo"]["beta_start"], summary["config"]["algo"]["q"]) == (1.0, 0.8)
    assert summary["config"]["experiment"] == str(best)

    again = run_sweep(path, workers=2, overrides=[f"run_root={root}"])  # the same study, continued: already done
    assert again["counts"] == {s.name.lower(): states.count(s) for s in set(states)} | {"fail": 0}
    assert len(optuna.load_study(study_name="tiny-sweep", storage=f"sqlite:///{root / 'optuna.db'}").trials) == 4
    assert again["mlflow_parent_run_id"] == parent[0].info.run_id
    assert len([r for r in _runs(uri, "tiny-sweep") if r.data.tags.get("empo2.role") == "study"]) == 1

    cmp = empo2("compare", "--experiment", "tiny-sweep", "--run-root", root, "--group-by", "trial")
    assert cmp.returncode == 0, cmp.stdout + cmp.stderr
    out = root / "compare" / "tiny-sweep"
    assert (out / "importance_tiny-sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert len((out / "trials_tiny-sweep.csv").read_text().splitlines()) == 5


GRIDS = PROJECT_DIR / "grids"


def test_grid_files_plan_every_preset_and_seed():
    grid_id, runs = plan_grid(GRIDS / "ablations_minisci.yaml", seeds="0,4", overrides=["model=tiny"])
    assert grid_id == "ablations_minisci" and len(runs) == 12
    r = runs[-1]
    assert (r.preset, r.seed, r.cfg.seed, r.cfg.model.name) == ("memory_only_minisci", 4, 4, "tiny")
    assert r.cfg.logger.tags == {"grid": "ablations_minisci", "seed": "4"}
    assert r.cfg.run_name == "ablations_minisci/memory_only_minisci-s4"
    assert {x.cfg.logger.experiment for x in runs} == {"empo2-ablations-minisci"}
    _, gpu_runs = plan_grid(GRIDS / "ablations.yaml", seeds=1)
    assert [r.preset for r in gpu_runs] == ["empo2_paper", "empo2_official", "grpo", "no_offpolicy",
                                            "no_intrinsic", "memory_only"]


def test_the_live_memory_headline_plans_its_prior_on_the_layout_it_was_trained_on():
    """The paper presets set tips_in_history=false; the *_minisci_tips presets put the prior's own layout back
    (the prior refuses any other) and keep the algorithm of the preset they build on, but for top_k."""
    grid_id, runs = plan_grid(GRIDS / "headline_minisci_tips.yaml", seeds=1)
    assert [r.preset for r in runs] == ["empo2_paper_minisci_tips", "grpo_minisci_tips", "no_offpolicy_minisci_tips",
                                        "no_intrinsic_minisci_tips", "memory_only_minisci_tips"]
    for r in runs:
        c, under = r.cfg, load_config([f"experiment={r.preset.removesuffix('_tips')}"])
        assert (c.model.name, c.rollout.history_turns, c.rollout.tips_in_history, c.memory.top_k, c.env.tasks) == \
            ("minisci_tips_reader", None, True, 3, ["find-living-thing"])
        assert c.trainer.val_train and c.env.val_split == "test" and c.torch_threads == 1
        assert dataclasses.asdict(c.algo) == dataclasses.asdict(under.algo)
    same = {r.preset: r.cfg for r in runs}
    for grid, top_k in (("rank_score", 3), ("top1", 1)):  # the same runs but for the memory's reading, logged apart
        _, ranked = plan_grid(GRIDS / f"headline_minisci_tips_{grid}.yaml", seeds=1)
        assert [r.preset for r in ranked] == [p for p in same if p != "grpo_minisci_tips"]
        for r in ranked:
            assert (r.cfg.memory.rank_by, r.cfg.memory.top_k) == ("score", top_k)
            assert dataclasses.replace(r.cfg.memory, rank_by="similarity", top_k=3) == same[r.preset].memory
            assert dataclasses.asdict(r.cfg.algo) == dataclasses.asdict(same[r.preset].algo)
            assert r.cfg.logger.experiment == f"empo2-headline-minisci-tips-{grid.replace('_', '-')}"
    # the signed prior's grid: every preset again, each differing from the one-tip grid's in the prior only
    _, signed = plan_grid(GRIDS / "headline_minisci_signed.yaml", seeds=1)
    assert [r.preset for r in signed] == list(same)
    for r in signed:
        assert (r.cfg.model.name, r.cfg.memory.top_k, r.cfg.memory.rank_by) == ("minisci_tips_signed", 1, "score")
        assert dataclasses.replace(r.cfg.memory, rank_by="similarity", top_k=3) == same[r.preset].memory
        assert dataclasses.replace(r.cfg.model, name="minisci_tips_reader") == same[r.preset].model
        assert dataclasses.asdict(r.cfg.algo) == dataclasses.asdict(same[r.preset].algo)
        assert dataclasses.asdict(r.cfg.rollout) == dataclasses.asdict(same[r.preset].rollout)
        assert dataclasses.asdict(r.cfg.env) == dataclasses.asdict(same[r.preset].env)
        assert dataclasses.asdict(r.cfg.trainer) == dataclasses.asdict(same[r.preset].trainer)


def test_the_powered_headline_is_empo2_against_grpo_on_ten_seeds_and_48_held_out_instances():
    """The decisive contrast of the signed grid again, powered: only the seeds and the held-out list differ."""
    from empo2.rollout.build import validation_tasks

    _, powered = plan_grid(GRIDS / "headline_minisci_signed_powered.yaml")
    _, signed = plan_grid(GRIDS / "headline_minisci_signed.yaml", seeds=1)
    assert sorted({r.preset for r in powered}) == ["empo2_paper_minisci_tips", "grpo_minisci_tips"]
    assert [r.seed for r in powered if r.preset == "grpo_minisci_tips"] == list(range(10))
    same = {r.preset: r.cfg for r in signed}
    for r in powered:
        held_out, training = validation_tasks(r.cfg), validation_tasks(r.cfg, on_train=True)
        assert len(held_out) == 48 and len(training) == 8 and r.cfg.trainer.val_train
        assert not {(t.task, t.variation) for t in held_out} & {(t.task, t.variation) for t in training}
        assert dataclasses.replace(r.cfg.env, val_variations=12) == same[r.preset].env
        for part in ("algo", "rollout", "memory", "model", "trainer"):
            assert getattr(r.cfg, part) == getattr(same[r.preset], part), part
        assert r.cfg.torch_threads == 1 and r.cfg.logger.experiment == "empo2-headline-minisci-signed-powered"


def test_shipped_sweeps_load():
    for name in ("empo2", "empo2_minisci"):
        spec = load_sweep(PROJECT_DIR / "sweeps" / f"{name}.yaml")
        assert {"algo.p", "algo.q", "algo.delta", "algo.beta_start"} <= {p.key for p in spec.space}
        delta = next(p for p in spec.space if p.key == "algo.delta")
        assert delta.log and delta.low > 0
        assert load_config(spec.base).experiment == spec.preset


@pytest.mark.parametrize("args, needle", [
    (["grid", "nope.yaml"], "grid file nope.yaml: no such file"),
    (["sweep", "nope.yaml"], "sweep file nope.yaml: no such file"),
    (["train", "experiment=no_such"], "experiment=no_such: unknown preset"),
    (["eval", "ckpt=/nowhere"], "ckpt=/nowhere: no checkpoint there"),
    (["compare", "--experiment", "x", "--run-root", "/nowhere"], "no MLflow database at /nowhere/mlflow.db"),
    (["train", "model=smolm2"], "model=smolm2: no such option (did you mean smollm2?); choose from hf, minisci_bc"),
    (["train", "algo.pp=0.3"], "algo.pp: unknown key; did you mean algo.p?"),
    (["train", "algo.p=abc"], "algo.p=abc: Value 'abc' of type 'str' could not be converted to Float"),
    (["config", "algoo"], "algoo: no such config section (did you mean algo?)"),
])
def test_user_mistakes_exit_2_with_one_line(args, needle):
    proc = empo2(*args, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("empo2 ")]
    assert len(lines) == 1 and needle in lines[0], proc.stderr


def test_config_lists_groups_and_fields_and_train_cfg_prints_the_resolved_config():
    groups = empo2("config", timeout=60)
    assert groups.returncode == 0 and "  model    hf, minisci_bc, minisci_tips" in groups.stdout
    algo = empo2("config", "algo", timeout=60).stdout
    # every field of the section, its default, its range and its documentation
    assert "  algo.p = 0.25   [>= 0 <= 1]" in algo and "Probability that a rollout is memory-augmented" in algo
    assert "  algo.mask_mode = 'token'   [token | sequence]" in algo
    resolved = empo2("train", "model=tiny", "algo.p=0.3", "run_root=/nonexistent/never", "--cfg", timeout=60)
    assert resolved.returncode == 0, resolved.stderr
    import yaml

    cfg = yaml.safe_load(resolved.stdout)
    assert cfg["algo"]["p"] == 0.3 and cfg["model"]["name"] == "tiny" and cfg["algo"]["q"] == 0.68
    assert not Path("/nonexistent/never").exists()  # printed, nothing run


def _no_java_path(tmp_path: Path) -> str:
    """A PATH that has everything of this one but `java`."""
    import shutil

    bare = tmp_path / "bin"
    bare.mkdir()
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        for tool in Path(folder).glob("*") if Path(folder).is_dir() else []:
            if tool.name != "java" and not (bare / tool.name).exists():
                (bare / tool.name).symlink_to(tool)
    assert shutil.which("java", path=str(bare)) is None
    return str(bare)


@pytest.mark.parametrize("args, needle", [
    (["env=scienceworld"], "env=scienceworld needs Java 11+ and no `java` on PATH"),
    (["engine=vllm"], "engine=vllm needs the vllm package"),
    (["trainer=gpu"], "trainer.accelerator=gpu needs a CUDA GPU"),
    (["trainer=fsdp"], "needs a CUDA GPU"),
    (["logger.experiment="], "logger.experiment='' is not allowed: MLflow needs an experiment name"),
    (["run_root={file}/runs"], "run_root={file}/runs cannot be used: {file} is a file, not a folder"),
    (["model=hf", "model.path={root}/no-model"], "holds no transformers checkpoint"),
])
def test_machine_mistakes_exit_2_with_one_line_fast_and_leave_no_run_folder(tmp_path, args, needle):
    import torch

    if "GPU" in needle and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    root, file = tmp_path / "runs", tmp_path / "a-file"
    file.write_text("")
    fill = {"root": root, "file": file}
    env = dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true", PATH=_no_java_path(tmp_path))
    # vllm is installed here: the vllm case runs the CLI as on a machine without it (the import system finds none)
    cli = ["-c", "import sys; sys.modules['vllm'] = None; from empo2.cli import main; sys.exit(main(sys.argv[1:]))"] \
        if "vllm" in needle else ["-m", "empo2.cli"]
    # -X importtime lists every module the process imported: "fast" is judged by what it did, not by a clock
    proc = subprocess.run([sys.executable, "-X", "importtime", *cli, "train", "model=tiny", f"run_root={root}",
                           *(a.format(**fill) for a in args)], capture_output=True, text=True, timeout=120, env=env)
    imported = {ln.rsplit("|", 1)[1].strip() for ln in proc.stderr.splitlines() if ln.startswith("import time:")}
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip() and not ln.startswith("import time:")]
    assert len(lines) == 1 and needle.format(**fill) in lines[0], lines
    assert not root.exists() or not any(root.iterdir()), "a failed start left a run folder"
    assert "torch" in imported and not {"lightning", "transformers", "mlflow"} & imported  # refused before them


def test_ctrl_c_reports_the_last_iteration_and_the_resume_command_and_exits_130(tmp_path):
    import signal

    args = ["train", *FAST, "logger=none", "trainer.iterations=30", "trainer.ckpt_every=1", f"run_root={tmp_path}",
            "run_name=r"]
    proc = subprocess.Popen([sys.executable, "-m", "empo2.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true"))
    deadline = time.monotonic() + 240
    while not list((tmp_path / "r" / "checkpoints").glob("iter-*.ckpt")) and time.monotonic() < deadline:
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out + err
    assert "Traceback" not in err and "graceful shutdown" not in out + err
    [line] = [ln for ln in err.splitlines() if "resume with:" in ln]
    command = line.split("resume with: ", 1)[1].split()
    assert command[:2] == ["empo2", "train"] and command[-2:] == ["run_name=r", "resume=auto"]
    assert "last finished iteration" in err
    # the printed command resumes the run (shortened to end soon)
    again = empo2(*command[1:], "trainer.iterations=3", timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert [h["iteration"] for h in summary["history"] if "rollout/return" in h] == [0, 1, 2]


def test_the_console_of_a_run_is_ours_only(tmp_path, monkeypatch):
    # Lightning checks only that an `srun` is on PATH, as on every node of a SLURM cluster
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "srun").write_text("#!/bin/sh\nexit 1\n")
    (tmp_path / "bin" / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    proc = empo2("train", *FAST, "trainer.iterations=1", f"run_root={tmp_path}", "run_name=q")
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = proc.stdout + proc.stderr
    for chatter in ("GPU available", "TPU available", "litlogger", "Loading weights", "INFO mlflow",
                    "max_epochs=", "Creating initial MLflow", "`srun` command is available"):
        assert chatter not in text, chatter
    assert "== empo2 run finished ==" in text
    verbose = empo2("--verbose", "train", *FAST, "trainer.iterations=1", f"run_root={tmp_path}", "run_name=v")
    assert "GPU available" in verbose.stdout + verbose.stderr  # --verbose brings the libraries back


def test_models_lists_each_preset_under_the_option_that_selects_it():
    proc = empo2("models", timeout=60)
    assert proc.returncode == 0, proc.stderr
    labels = [ln.split()[0] for ln in proc.stdout.splitlines() if ln.startswith("model=")]
    assert {"model=smollm2", "model=tiny", "model=minisci_tips", "model=minisci_tips_reader",
            "model=minisci_tips_signed", "model=qwen2.5-7b"} <= set(labels)
    for shipped in ("model=minisci_tips_reader", "model=minisci_tips_signed"):
        assert proc.stdout.split(shipped, 1)[1].split("\n")[1].strip() == "-> available (shipped)"
    for label in labels:  # each one is a working override naming that preset
        name = proc.stdout.split(label, 1)[1].split("\n", 1)[0].rsplit("[", 1)[1].rstrip("]")
        overrides = [label] + (["model.path=/tmp"] if label == "model=hf" else [])
        assert load_config(overrides).model.name == name

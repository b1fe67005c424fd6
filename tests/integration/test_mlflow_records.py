"""What a researcher finds in MLflow after the daily loop: one experiment marked as model training, the
training run, its eval and adapt as runs of their own (config, tags, scores, files), compare's grouping of
a sweep's trials, and the UI itself rendering a run. Real MLflow (sqlite), real Lightning, the tiny model."""

import csv
import json
import os
import re
import shutil
import subprocess

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from empo2.config import ConfigError
from empo2.workflows.compare import compare
from empo2.workflows.evaluate import adapt, resolve_checkpoint, run_config
from empo2.workflows.tracking import EXPERIMENT_KIND, experiment_id, ui_link
from tests.integration.test_workflows import FAST, empo2
from tests.services import free_port, start_mlflow

PRESET = "empo2_official_minisci"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One short training run through the command, tracked in a fresh sqlite store."""
    root = tmp_path_factory.mktemp("tracked")
    proc = empo2("train", f"experiment={PRESET}", *FAST, "trainer.iterations=1", f"run_root={root}",
                 "run_name=ui-run")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((root / "ui-run" / "summary.json").read_text())
    client = MlflowClient(summary["mlflow_tracking_uri"])
    return {"root": root, "run_dir": root / "ui-run", "summary": summary, "client": client,
            "run": client.get_run(summary["mlflow_run_id"]), "stdout": proc.stdout}


def _only_run(trained, kind: str):
    [run] = trained["client"].search_runs([trained["run"].info.experiment_id], f"tags.kind = '{kind}'")
    return run


def test_the_experiment_opens_on_runs_and_the_report_links_the_run_in_that_view(trained):
    client, run = trained["client"], trained["run"]
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.tags.get(EXPERIMENT_KIND[0]) == EXPERIMENT_KIND[1]
    assert run.data.tags["kind"] == "train" and run.data.tags["preset"] == PRESET
    link = ui_link("http://127.0.0.1:5000", experiment.experiment_id, run.info.run_id)
    assert link.endswith(f"/runs/{run.info.run_id}?workflowType=machine_learning")
    assert link in trained["stdout"]


def test_a_run_roots_files_stay_under_it_whatever_the_working_directory(trained):
    """The run's files go to `mlartifacts/` beside the sqlite store, not to the `./mlruns` of whatever
    directory the command ran in."""
    client, run = trained["client"], trained["run"]
    home = trained["root"] / "mlartifacts"
    assert client.get_experiment(run.info.experiment_id).artifact_location == home.as_uri()
    files = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert files and all((home / run.info.run_id / "artifacts" / f).exists() for f in files)
    assert not (trained["root"].parent / "mlruns").exists() and not os.path.exists("mlruns")


def test_experiment_id_marks_new_and_unmarked_experiments_and_keeps_a_kind_set_by_hand(tmp_path):
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    key, value = EXPERIMENT_KIND
    new = experiment_id(client, "new")
    assert client.get_experiment(new).tags[key] == value
    old = client.create_experiment("old")  # made before experiments were marked
    assert key not in client.get_experiment(old).tags
    assert experiment_id(client, "old") == old and client.get_experiment(old).tags[key] == value
    chosen = client.create_experiment("chosen", tags={key: "genai_development"})
    assert experiment_id(client, "chosen") == chosen
    assert client.get_experiment(chosen).tags[key] == "genai_development"


def test_eval_is_a_run_of_the_checkpoints_experiment_with_its_config_tags_scores_and_files(trained):
    out = trained["root"] / "eval"
    proc = empo2("eval", f"ckpt={trained['run_dir']}", "memory=both", "variations=1", f"out={out}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "eval_test.json").read_text())
    run, train_run = _only_run(trained, "eval"), trained["run"]
    assert f"MLflow run {run.info.run_id} (eval)" in proc.stdout
    assert run.info.status == "FINISHED" and run.info.run_name == "ui-run-eval-test"
    for tag in ("preset", "seed", "algo", "env", "model", "git_commit"):
        assert run.data.tags[tag] == train_run.data.tags[tag], tag
    assert run.data.tags["source_run"] == train_run.info.run_id
    params = run.data.params
    assert params["algo.p"] == train_run.data.params["algo.p"] and params["model.name"] == "tiny"
    assert (params["eval.split"], params["eval.memory"], params["eval.variations"]) == ("test", "both", "1")
    metrics = run.data.metrics
    for mode in ("nomem", "mem"):
        result = report["modes"][mode]
        assert metrics[f"eval/score_{mode}"] == pytest.approx(result["score"])
        assert metrics[f"eval/success_{mode}"] == pytest.approx(result["success"])
        for task, stats in result["per_task"].items():
            assert metrics[f"eval/{task}/score_{mode}"] == pytest.approx(stats["score"])
    files = {a.path for a in trained["client"].list_artifacts(run.info.run_id)}
    assert files == {"eval_test.json", "eval_test.md"}


def test_adapt_is_a_run_with_the_score_of_every_trial_with_and_without_tips(trained):
    ckpt = resolve_checkpoint(str(trained["run_dir"]))
    out = trained["root"] / "adapt"
    report = adapt(run_config(ckpt, []), ckpt, trials=2, variations=1, out=out)
    run = _only_run(trained, "adapt")
    assert report["mlflow_run_id"] == run.info.run_id and run.data.tags["preset"] == PRESET
    assert run.data.params["adapt.trials"] == "2" and run.data.params["memory.enabled"] == "True"
    client = trained["client"]
    for key, values in (("adapt/score_mem", [t["score"] for t in report["trials"]]),
                        ("adapt/score_nomem", [t["nomem"]["score"] for t in report["trials"]]),
                        ("adapt/memory_size", [t["memory_size"] for t in report["trials"]])):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert history == [(1, pytest.approx(values[0])), (2, pytest.approx(values[1]))], key
    assert "adapt/change-state/success_nomem" in run.data.metrics  # per task too (MiniSci's held-out task)
    assert [t["nomem"]["episodes"] for t in report["trials"]] == [t["episodes"] for t in report["trials"]]
    files = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert files == {"adapt.json", "adapt.md", "adapt_curve.png"}
    assert "score (tip-free)" in (out / "adapt.md").read_text().splitlines()[0]


def test_eval_with_the_tracking_store_away_says_so_in_one_line_and_keeps_its_files(trained):
    out = trained["root"] / "eval-away"
    away = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proc = empo2("eval", f"ckpt={trained['run_dir']}", "memory=off", "variations=1", f"out={out}",
                 f"logger.tracking_uri={away}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "MLflow" in ln]
    assert len(said) == 1 and said[0].startswith(f"could not record the eval as an MLflow run in {away} (")
    assert (out / "eval_test.json").is_file() and (out / "eval_test.md").is_file()


def test_compare_groups_a_sweeps_runs_by_trial_unless_told_otherwise(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = experiment_id(client, "sweep")
    for trial, score in ((0, 10.0), (1, 30.0)):
        tags = {"kind": "train", "preset": "grpo_minisci", "trial": str(trial)}
        run_id = client.create_run(exp, tags=tags).info.run_id
        client.log_metric(run_id, "rollout/score", score, step=0)
        client.set_terminated(run_id)
    evaluated = client.create_run(exp, tags={"kind": "eval", "preset": "grpo_minisci", "trial": "0"}).info.run_id
    client.log_metric(evaluated, "rollout/score", 99.0)  # an eval run never counts as a training run
    client.set_terminated(evaluated)

    proc = empo2("compare", "--experiment", "sweep", "--tracking-uri", uri, "--out", tmp_path / "by-trial")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = (tmp_path / "by-trial" / "compare.md").read_text()
    assert "| trial | runs | rollout/score |" in table and "| 0 | 1 | 10 |" in table and "| 1 | 1 | 30 |" in table
    merged = compare("sweep", uri, tmp_path / "by-preset", group_by="preset")
    assert merged["group_by"] == "preset"
    assert [(r["group"], r["runs"], r["rollout/score"][0]) for r in merged["rows"]] == [("grpo_minisci", 2, 20.0)]


def test_compare_reports_where_each_group_started_and_pairs_groups_by_seed(tmp_path):
    """Runs logged by hand into real MLflow: validation before training (step -1) and at the end, two presets x
    two seeds (seed 1 of the second preset missing, so one pair is left)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = experiment_id(client, "grid")
    runs = {("grpo", "0"): (20.0, 40.0), ("grpo", "1"): (30.0, 36.0), ("empo2", "0"): (20.0, 50.0)}
    for (preset, seed), (start, end) in runs.items():
        run_id = client.create_run(exp, tags={"kind": "train", "preset": preset, "seed": seed}).info.run_id
        client.log_metric(run_id, "val/score_nomem", start, step=-1)
        client.log_metric(run_id, "val/score_nomem", end, step=9)
        client.set_terminated(run_id)
    result = compare("grid", uri, tmp_path / "cmp", baseline="grpo")
    rows = {r["group"]: r for r in result["rows"]}
    assert rows["grpo"]["val/score_nomem (before)"][0] == 25.0 and rows["grpo"]["val/score_nomem"][0] == 38.0
    assert rows["empo2"]["val/score_nomem (before)"][0] == 20.0
    [paired] = result["paired"]
    assert paired["group"] == "empo2" and paired["val/score_nomem"][0] == 10.0 and paired["val/score_nomem"][3] == 1
    assert paired["val/score_nomem (before)"][0] == 0.0  # seed 0 of both started from the same policy
    assert "| empo2 | +10 (1 pair) | +0 (1 pair) |" in (tmp_path / "cmp" / "paired.md").read_text()
    again = client.create_run(exp, tags={"kind": "train", "preset": "grpo", "seed": "0"}).info.run_id
    client.log_metric(again, "val/score_nomem", 44.0, step=9)
    client.set_terminated(again)  # a seed run twice cannot be paired: refused, naming the group and seed
    with pytest.raises(ConfigError, match=r"group 'grpo' has two finished runs of seed 0"):
        compare("grid", uri, tmp_path / "cmp2", baseline="grpo")


def test_compare_reads_runs_logged_before_the_rollout_metrics_were_renamed(tmp_path):
    """A run logged `rollout/score_tipfree` and `rollout/score_memory` (today `rollout/score_nomem`, `_mem`): its
    values, curves and groups count under today's names, beside a run logged with them, whichever name is asked."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = experiment_id(client, "grid")
    for seed, (nomem, mem) in ((("0", "rollout/score_tipfree", "rollout/score_memory"), (10.0, 30.0)),
                               (("1", "rollout/score_nomem", "rollout/score_mem"), (20.0, 50.0))):
        run_id = client.create_run(exp, tags={"kind": "train", "preset": "empo2", "seed": seed[0]}).info.run_id
        for step in (0, 1):
            client.log_metric(run_id, seed[1], nomem + step, step=step)
            client.log_metric(run_id, seed[2], mem + step, step=step)
        client.set_terminated(run_id)
    for asked in (["rollout/score_nomem", "rollout/score_mem"], ["rollout/score_tipfree", "rollout/score_memory"]):
        result = compare("grid", uri, tmp_path / "cmp", metrics=asked)
        assert result["metrics"] == ["rollout/score_nomem", "rollout/score_mem"]
        [row] = result["rows"]
        assert row["runs"] == 2 and row["rollout/score_nomem"][0] == 16.0 and row["rollout/score_mem"][0] == 41.0
    assert (tmp_path / "cmp" / "curve_rollout_score_nomem.png").is_file()
    from empo2.workflows.compare import _history  # what the curves and the before-training values read

    old = next(r for r in client.search_runs([exp]) if r.data.tags["seed"] == "0")
    assert [p.value for p in _history(client, old, "rollout/score_nomem")] == [10.0, 11.0]


def test_compare_resamples_seeds_then_instances_where_runs_logged_each_instance(tmp_path):
    """Validation logs each instance's score beside the mean: there the intervals are the two-level bootstrap
    (seeds, then instances), elsewhere the t-interval over seeds, and each table says which."""
    from empo2.algo.stats import T_SEEDS, TWO_LEVEL, t_interval, two_level_bootstrap

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = experiment_id(client, "grid")
    scores = {"grpo": [[10.0, 30.0, 20.0], [40.0, 20.0, 30.0], [0.0, 10.0, 50.0]],
              "empo2": [[20.0, 30.0, 40.0], [50.0, 20.0, 50.0], [10.0, 30.0, 50.0]]}  # per seed, instances a, b, c
    for preset, per_seed in scores.items():
        for seed, values in enumerate(per_seed):
            run_id = client.create_run(exp, tags={"kind": "train", "preset": preset, "seed": str(seed)}).info.run_id
            client.log_metric(run_id, "val/score_nomem", float(np.mean(values)), step=9)
            client.log_metric(run_id, "rollout/score", float(seed), step=9)
            for inst, v in zip("abc", values):
                client.log_metric(run_id, f"val/score_nomem/find-living-thing-{inst}", v, step=9)
            client.set_terminated(run_id)
    out = tmp_path / "cmp"
    result = compare("grid", uri, out, baseline="grpo", metrics=["val/score_nomem", "rollout/score"])
    rows = {r["group"]: r for r in result["rows"]}
    for preset, per_seed in scores.items():
        mean, low, high = two_level_bootstrap(per_seed)
        assert rows[preset]["val/score_nomem"] == pytest.approx((mean, np.std(np.mean(per_seed, axis=1), ddof=1),
                                                                low, high))
        assert rows[preset]["methods"] == {"val/score_nomem": TWO_LEVEL, "rollout/score": T_SEEDS}
        assert rows[preset]["rollout/score"][2:] == pytest.approx(t_interval([0.0, 1.0, 2.0])[1:])
    [paired] = result["paired"]
    diffs = (np.array(scores["empo2"]) - np.array(scores["grpo"])).tolist()  # per seed, per instance
    assert paired["val/score_nomem"] == pytest.approx((*two_level_bootstrap(diffs), 3))
    assert paired["methods"]["val/score_nomem"] == TWO_LEVEL and paired["methods"]["rollout/score"] == T_SEEDS
    for name in ("compare.md", "paired.md"):
        assert f"Intervals: {TWO_LEVEL} (val/score_nomem); {T_SEEDS} (rollout/score)" in (out / name).read_text()
    with open(out / "compare.csv") as f:
        table = {r["preset"]: r for r in csv.DictReader(f)}
    assert table["grpo"]["val/score_nomem ci_method"] == TWO_LEVEL
    with open(out / "instances.csv") as f:
        per_instance = list(csv.DictReader(f))
    assert len(per_instance) == 2 * 3 * 3 and per_instance[0]["instance"] == "find-living-thing-a"
    assert float(per_instance[0]["value"]) == scores["empo2"][0][0]  # groups in order: empo2, then grpo


def _chromium(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([shutil.which("chromium"), "--headless", "--no-sandbox", "--disable-gpu",
                           "--window-size=1280,1400", "--virtual-time-budget=20000", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
@pytest.mark.needs("chromium")
def test_the_mlflow_ui_renders_the_run_with_its_params_and_tags(trained, tmp_path):
    server = start_mlflow(trained["summary"]["mlflow_tracking_uri"], tmp_path / "server", serve_artifacts=False)
    base = server.uri
    try:
        run = trained["run"]
        pages = {"experiment": ui_link(base, run.info.experiment_id),
                 "run": ui_link(base, run.info.experiment_id, run.info.run_id)}
        dom = {name: _chromium("--dump-dom", url).stdout for name, url in pages.items()}
        assert ">ui-run<" in dom["experiment"]  # the runs table, not the GenAI overview
        shown = {"algo.p": run.data.params["algo.p"], "preset": PRESET, "seed": "0", "kind": "train"}
        for key, value in shown.items():  # a param's or a tag's name, then its value in the same row
            assert re.search(rf">{re.escape(key)}</span>.{{0,400}}?{re.escape(value)}<", dom["run"], re.S), key
        for name, url in pages.items():
            png = tmp_path / f"{name}.png"
            _chromium(f"--screenshot={png}", url)
            assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 20000, name
    finally:
        server.stop()

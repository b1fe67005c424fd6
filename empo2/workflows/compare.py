"""`empo2 compare`: final metrics and learning curves of an MLflow experiment, grouped (by preset, say).

For every finished training run of the experiment (eval and adapt runs, tagged `kind`, are left out) it
reads the final value of each metric (MLflow's latest, which is what the run's summary.json holds as well)
and its history, groups the runs by a tag (`preset`, `grid`, `trial`, ...) or a logged parameter (default:
`trial` when the runs are a sweep's trials, else `preset`), and writes:

- `compare.md` and `compare.csv`: per group the number of runs and, for each metric, the mean ± std (sample
  std over runs, i.e. seeds) and a 95% interval of the mean, with the method that made it (`ci_method`): seeds
  are the unit of replication, so a Student-t interval over the runs (`empo2.algo.stats.t_interval`), or where the runs
  logged each instance's value (`val/score_nomem/<task>-<variation>`, ...) a two-level bootstrap, seeds then
  instances within each (`empo2.algo.stats.two_level_bootstrap`); where runs drew
  memory modes, also what the tips add like for like over each run (`rollout/memory_gain (run)`: in every group
  of one instance, iteration and weights holding both, the score with tips minus tip-free, averaged over those
  groups; `rollout/memory_gain_groups (run)`: how many) and, for p = 1, `rollout/first_visit_gain` (later visits
  with tips minus the same instance's tip-free first visit);
- `runs.csv`: every run's own values (group, seed, run, each metric), and `instances.csv` each instance's where
  the runs logged them, so every interval can be recomputed;
- for each validation metric, its value before training (`<metric> (before)`, from runs with
  `trainer.val_before_train`), so a table shows where every group started;
- with a baseline group (`--baseline grpo`): `paired.md` and `paired.csv`, every other group's final metrics
  minus the baseline's, paired by seed (the runs of one seed share their instances and validation draws, so
  the paired interval, over the per-seed differences (per instance where logged, as above), is usually narrower
  than the two groups' intervals suggest);
- `curve_<metric>.png`: per group the mean learning curve over runs with a ±1 std band;
- for every Optuna study in the experiment (its parent run is tagged `empo2.role=study`):
  `importance_<study>.png` (parameter importances) and `trials_<study>.csv` (every trial).
"""

from __future__ import annotations

import csv
import math
import re
from collections import defaultdict
from pathlib import Path

import numpy as np

from empo2.algo.stats import T_SEEDS, TWO_LEVEL, t_interval, two_level_bootstrap
from empo2.config import ConfigError, current_metric, current_model

# scores and the extrinsic return: `rollout/return` includes the novelty bonus, so it does not compare
# EMPO² with GRPO like for like
DEFAULT_METRICS = ("val/score_nomem", "val/success_nomem", "val/score_mem", "val/success_mem",
                   "val_train/score_nomem", "rollout/score", "rollout/success", "rollout/ext_return",
                   "rollout/first_visit_gain", "rollout/first_visit_gain_instances")
STUDY_ROLE = ("empo2.role", "study")
# What the tips add like for like over a run (from the per-iteration `rollout/memory_gain`), and on how many groups
GAIN, GAIN_GROUPS = "rollout/memory_gain (run)", "rollout/memory_gain_groups (run)"


def run_memory_gain(history: list[dict]) -> tuple[float, int] | None:
    """(gain, groups) of a run: the per-iteration `rollout/memory_gain` weighted by `rollout/memory_gain_groups`,
    i.e. the mean over every group of the run that held both rollouts with tips and tip-free ones; None where
    no group did."""
    n = sum(h.get("rollout/memory_gain_groups", 0.0) for h in history)
    if not n:
        return None
    total = sum(h["rollout/memory_gain_groups"] * h["rollout/memory_gain"] for h in history
                if h.get("rollout/memory_gain_groups"))
    return total / n, int(n)


def paired_difference(group: dict[str, float], baseline: dict[str, float]) -> tuple[float, float, float, int]:
    """(mean, ci95 low, ci95 high, pairs) of group − baseline over the seeds both have, the interval a t-interval
    over the per-seed differences (the paired t-test's); group, baseline: {seed: final value}. NaN where no seed is
    shared; NaN interval for a single pair."""
    seeds = sorted(set(group) & set(baseline))
    diffs = np.array([group[s] - baseline[s] for s in seeds], dtype=float)  # (pairs,)
    if not len(diffs):
        return math.nan, math.nan, math.nan, 0
    mean, low, high = t_interval(diffs)
    return mean, low, high, len(diffs)


def paired_instances(group: dict[str, dict[str, float]], baseline: dict[str, dict[str, float]]
                     ) -> tuple[float, float, float, int]:
    """(mean, ci95 low, ci95 high, pairs) of group − baseline where each run logged its instances' values:
    group, baseline: {seed: {instance: final value}}; per seed, the differences on the instances both runs
    have, then the two-level bootstrap over seeds and those instances."""
    seeds = sorted(set(group) & set(baseline))
    units = [[group[s][i] - baseline[s][i] for i in sorted(set(group[s]) & set(baseline[s]))] for s in seeds]
    mean, low, high = two_level_bootstrap([u for u in units if u])
    return mean, low, high, len(seeds)


def _instances(final: dict[str, float], metric: str) -> dict[str, float]:
    """{instance: value} of a run's per-instance values of `metric` (logged as `<metric>/<instance>`)."""
    head = metric + "/"
    return {k[len(head):]: v for k, v in final.items() if k.startswith(head)}


def _seed(run) -> str | None:
    return run.data.tags.get("seed", run.data.params.get("seed"))


def _by_seed(runs: list, finals: dict, metric: str, group: str) -> dict[str, float]:
    """{seed: final value of metric} of a group's runs; a seed run twice cannot be paired and is refused."""
    values: dict[str, float] = {}
    for r in runs:
        seed = _seed(r)
        if metric not in finals[r.info.run_id]:
            continue
        if seed in values:
            raise ConfigError(f"--baseline pairs runs by seed, but group {group!r} has two finished runs of seed "
                              f"{seed}; delete one or compare them in separate experiments")
        values[seed] = finals[r.info.run_id][metric]
    return values


def _client(tracking_uri: str):
    from mlflow.tracking import MlflowClient

    if tracking_uri.startswith("sqlite:///") and not Path(tracking_uri[len("sqlite:///"):]).is_file():
        path = tracking_uri[len("sqlite:///"):]
        raise ConfigError(f"no MLflow database at {path} (give --tracking-uri or --run-root)")
    return MlflowClient(tracking_uri)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")


SUMMARY = ("mean", "std", "ci95_low", "ci95_high")


def _summarize(values: list[float], units: list[list[float]] | None = None
               ) -> tuple[tuple[float, float, float, float], str]:
    """(mean, sample std (ddof=1), and the 95% interval of the mean over runs), and the interval's method: the
    t-interval over runs (seeds), or with `units` (per run, its instances' values) the two-level bootstrap. The std
    and interval of a single run are NaN, not 0: one seed shows no spread."""
    arr = np.asarray(values, dtype=float)
    if len(arr) < 2:
        return (float(arr.mean()), math.nan, math.nan, math.nan), T_SEEDS
    _, low, high = two_level_bootstrap(units) if units else t_interval(arr)
    return (float(arr.mean()), float(arr.std(ddof=1)), low, high), TWO_LEVEL if units else T_SEEDS


def _fmt(mean: float, std: float, low: float, high: float) -> str:
    if math.isnan(mean):
        return "—"  # no run of the group logs this metric (e.g. val/score_mem without memory)
    return f"{mean:.4g}" if math.isnan(std) else f"{mean:.4g} ± {std:.2g} [{low:.4g}, {high:.4g}]"


def _memory_gain(client, run) -> dict[str, float]:
    """The run's `GAIN` and `GAIN_GROUPS`, from its per-iteration history in MLflow (absent where no group held
    both kinds of rollout)."""
    steps: dict[int, dict] = defaultdict(dict)
    for key in ("rollout/memory_gain", "rollout/memory_gain_groups"):
        for point in client.get_metric_history(run.info.run_id, key):
            steps[point.step][key] = point.value
    gain = run_memory_gain([steps[k] for k in sorted(steps)])
    return {} if gain is None else {GAIN: gain[0], GAIN_GROUPS: float(gain[1])}


def _logged(run) -> dict[str, float]:
    """A run's final metrics under today's names (a run logged before a rename keeps its old names in MLflow)."""
    return {current_metric(k): v for k, v in run.data.metrics.items()}


def _history(client, run, metric: str) -> list:
    """A run's history of `metric`, read under the name the run logged it as."""
    stored = next((k for k in run.data.metrics if k != metric and current_metric(k) == metric), metric)
    return client.get_metric_history(run.info.run_id, stored)


def _group_order(name: str) -> tuple:
    """Numeric groups (seeds, trial numbers) in numeric order, then the rest alphabetically."""
    return (0, int(name), "") if name.isdigit() else (1, 0, name)


def compare(experiment: str, tracking_uri: str, out: str | Path, group_by: str | None = None,
            metrics: list[str] | None = None, storage: str | None = None, x: str | None = None,
            baseline: str | None = None) -> dict:
    """Write the table, the curves and (for sweeps) the importance plots; returns the table rows, the
    grouping and the paths written. `storage` overrides the Optuna storage URL recorded on a study's run.
    `x`: a metric logged at every iteration (`train/env_steps`) to plot the curves against instead of
    the iteration, e.g. to compare methods at equal environment steps. `baseline`: a group to pair every other
    group with, seed by seed (paired.md, paired.csv)."""
    client = _client(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        names = sorted(e.name for e in client.search_experiments())
        raise ConfigError(f"no MLflow experiment {experiment!r} in {tracking_uri} (found: {', '.join(names)})")
    runs = client.search_runs([exp.experiment_id], max_results=50000)
    studies = [r for r in runs if r.data.tags.get(STUDY_ROLE[0]) == STUDY_ROLE[1]]
    study_ids = {r.info.run_id for r in studies}
    finished = [r for r in runs if r.info.status == "FINISHED" and r.info.run_id not in study_ids and r.data.metrics
                and r.data.tags.get("kind", "train") == "train"]
    if not finished:
        raise ConfigError(f"experiment {experiment!r} has no finished runs with metrics")
    if group_by is None:  # a sweep's trials share their preset: one row per trial, not one for the whole sweep
        group_by = "trial" if any("trial" in r.data.tags for r in finished) else "preset"
    groups: dict[str, list] = defaultdict(list)
    for r in finished:
        key = r.data.tags.get(group_by, r.data.params.get(group_by))
        if key is not None and group_by in ("model", "model.name"):  # a run tagged before its preset's rename
            key = current_model(key)
        groups[str(key) if key is not None else "(none)"].append(r)
    if baseline is not None and baseline not in groups:
        raise ConfigError(f"--baseline {baseline!r} is not a group of {experiment!r} grouped by {group_by} "
                          f"(groups: {', '.join(sorted(groups, key=_group_order))})")
    present = {k for r in finished for k in _logged(r)}
    x = current_metric(x) if x else x
    metrics = [current_metric(m) for m in metrics] if metrics else [m for m in DEFAULT_METRICS if m in present]
    missing = [m for m in metrics + ([x] if x else []) if m not in present]
    if missing or not metrics:
        raise ConfigError(f"metric {missing[0] if missing else '(none)'} is not logged by any run of {experiment!r} "
                          f"(logged: {', '.join(sorted(present))})")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)

    finals = {r.info.run_id: _logged(r) for r in finished}
    gains = []  # derived per run: what the tips add like for like over the run, and on how many groups
    if "rollout/memory_gain" in present:
        for r in finished:
            finals[r.info.run_id].update(_memory_gain(client, r))
        gains = [GAIN, GAIN_GROUPS]
    before = []
    for m in (m for m in metrics if m.startswith("val")):  # validation before training is logged at step -1
        for r in finished:
            first = [p.value for p in _history(client, r, m) if p.step < 0]
            if first:
                finals[r.info.run_id][f"{m} (before)"] = first[0]
        before += [f"{m} (before)"] if any(f"{m} (before)" in f for f in finals.values()) else []
    derived = before + gains
    rows = []
    for name in sorted(groups, key=_group_order):
        row = {"group": name, "runs": len(groups[name]), "methods": {}}
        for m in metrics + derived:
            have = [finals[r.info.run_id] for r in groups[name] if m in finals[r.info.run_id]]
            units = [[v for _, v in sorted(_instances(f, m).items())] for f in have]
            row[m], row["methods"][m] = _summarize([f[m] for f in have], units if all(units) else None) \
                if have else ((math.nan,) * len(SUMMARY), T_SEEDS)
        rows.append(row)
    table_md, table_csv = out / "compare.md", out / "compare.csv"
    _write_tables(rows, metrics + derived, group_by, experiment, table_md, table_csv)
    _write_runs(groups, finals, metrics + derived, group_by, out / "runs.csv")
    paired = []
    if baseline is not None:
        base = {m: _by_seed(groups[baseline], finals, m, baseline) for m in metrics + derived}
        for name in sorted(groups, key=_group_order):
            if name != baseline:
                paired.append(_paired_row(name, groups[name], groups[baseline], finals, metrics + derived, base))
        _write_paired(paired, metrics + derived, group_by, baseline, experiment, out / "paired.md", out / "paired.csv")
    curves = [_plot_curve(client, groups, m, out / f"curve_{_slug(m)}.png", x) for m in metrics]
    sweep_files = []
    for study_run in studies:
        sweep_files += _study_outputs(study_run, storage, out)
    return {"rows": rows, "metrics": metrics + derived, "group_by": group_by, "table": str(table_md),
            "csv": str(table_csv), "runs": str(out / "runs.csv"), "paired": paired, "curves": [str(p) for p in curves],
            "sweep": [str(p) for p in sweep_files], "out": str(out)}


def _paired_row(name: str, runs: list, base_runs: list, finals: dict, metrics: list[str], base: dict) -> dict:
    """One group's differences from the baseline, per metric, with each interval's method: the two-level bootstrap
    where every paired run of both logged its instances' values, else the t-interval over the per-seed ones."""
    row = {"group": name, "methods": {}}
    for m in metrics:
        values = _by_seed(runs, finals, m, name)
        units = {_seed(r): _instances(finals[r.info.run_id], m) for r in runs if _seed(r) in values}
        base_units = {_seed(r): _instances(finals[r.info.run_id], m) for r in base_runs if _seed(r) in base[m]}
        shared = set(values) & set(base[m])
        if len(shared) >= 2 and all(set(units[s]) & set(base_units[s]) for s in shared):
            row[m], row["methods"][m] = paired_instances(units, base_units), TWO_LEVEL
        else:
            row[m], row["methods"][m] = paired_difference(values, base[m]), T_SEEDS
    return row


def _methods_line(rows: list[dict], metrics: list[str]) -> str:
    """Which interval method each metric's intervals used, e.g. `Intervals: t over seeds (a, b); ...`."""
    used: dict[str, list[str]] = defaultdict(list)
    for m in metrics:
        for method in sorted({row["methods"][m] for row in rows}):
            used[method].append(m)
    return "Intervals: " + "; ".join(f"{method} ({', '.join(ms)})" for method, ms in used.items())


def _write_tables(rows: list[dict], metrics: list[str], group_by: str, experiment: str, md: Path, csv_path: Path):
    head = [group_by, "runs", *metrics]
    lines = [f"# {experiment}: final metrics, mean ± std over runs [95% interval of the mean]", "",
             _methods_line(rows, metrics), "",
             "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    for row in rows:
        lines.append("| " + " | ".join([str(row["group"]), str(row["runs"])] + [_fmt(*row[m]) for m in metrics]) + " |")
    md.write_text("\n".join(lines) + "\n")
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([group_by, "runs"] + [f"{m} {s}" for m in metrics for s in (*SUMMARY, "ci_method")])
        for row in rows:
            w.writerow([row["group"], row["runs"]] + [v for m in metrics for v in (*map(repr, row[m]),
                                                                                   row["methods"][m])])


def _write_runs(groups: dict[str, list], finals: dict, metrics: list[str], group_by: str, path: Path) -> None:
    """One row per run: its group, seed, name and id, and its own value of every metric (empty where it has none),
    the values every interval of the report is computed from; and where runs logged their instances' values,
    `instances.csv`, one row per run, metric and instance."""
    ordered = [(name, r) for name in sorted(groups, key=_group_order)
               for r in sorted(groups[name], key=lambda r: (_group_order(str(_seed(r))), r.info.run_name or ""))]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([group_by, "seed", "run_name", "run_id", *metrics])
        for name, r in ordered:
            values = finals[r.info.run_id]
            w.writerow([name, _seed(r), r.info.run_name, r.info.run_id]
                       + [repr(values[m]) if m in values else "" for m in metrics])
    per_instance = [[name, _seed(r), r.info.run_name, m, inst, repr(v)] for name, r in ordered for m in metrics
                    for inst, v in sorted(_instances(finals[r.info.run_id], m).items())]
    path.with_name("instances.csv").unlink(missing_ok=True)  # never one of an earlier comparison
    if per_instance:
        with open(path.with_name("instances.csv"), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow([group_by, "seed", "run_name", "metric", "instance", "value"])
            w.writerows(per_instance)


def _write_paired(rows: list[dict], metrics: list[str], group_by: str, baseline: str, experiment: str, md: Path,
                  csv_path: Path):
    def cell(mean, low, high, n):
        mean, low, high = (round(v, 9) + 0.0 for v in (mean, low, high))  # a difference of equal floats reads +0
        return "—" if n == 0 else f"{mean:+.4g} (1 pair)" if n == 1 else f"{mean:+.4g} [{low:+.4g}, {high:+.4g}] ({n})"

    lines = [f"# {experiment}: final metrics minus {baseline}'s, paired by seed: mean difference [95% interval] "
             "(pairs)", "", _methods_line(rows, metrics), "", "| " + " | ".join([group_by, *metrics]) + " |",
             "|" + "---|" * (len(metrics) + 1)]
    lines += ["| " + " | ".join([row["group"]] + [cell(*row[m]) for m in metrics]) + " |" for row in rows]
    md.write_text("\n".join(lines) + "\n")
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([group_by] + [f"{m} {s}" for m in metrics for s in ("diff", "ci95_low", "ci95_high", "pairs",
                                                                        "ci_method")])
        for row in rows:
            w.writerow([row["group"]] + [v for m in metrics for v in (*map(repr, row[m]), row["methods"][m])])


def group_curve(runs: list[tuple[dict[int, float], dict[int, float] | None]]):
    """(x, mean, std) of a group's curve. runs: per run, {step: metric value} and {step: x value} (None: x is
    the step). At every step some run reached: x and the metric averaged over the runs that have it, and the
    sample std of the metric (0 with one run)."""
    ys_at: dict[int, list[float]] = defaultdict(list)
    xs_at: dict[int, list[float]] = defaultdict(list)
    for ys, xs in runs:
        for step, y in ys.items():
            ys_at[step].append(y)
            xs_at[step].append(xs[step] if xs is not None else step)
    steps = sorted(ys_at)
    where = np.array([np.mean(xs_at[s]) for s in steps])
    mean = np.array([np.mean(ys_at[s]) for s in steps])
    std = np.array([np.std(ys_at[s], ddof=1) if len(ys_at[s]) > 1 else 0.0 for s in steps])
    return where, mean, std


def _plot_curve(client, groups: dict, metric: str, path: Path, x: str | None = None) -> Path:
    """Mean over a group's runs at every step that at least one run reached, ±1 std shaded; with `x`,
    placed at the mean over those runs of metric `x` at that step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in sorted(groups, key=_group_order):
        runs = []
        for r in groups[name]:
            ys = {p.step: p.value for p in _history(client, r, metric)}
            runs.append((ys, {p.step: p.value for p in _history(client, r, x)} if x else None))
        where, mean, std = group_curve(runs)
        if not len(where):
            continue
        line = ax.plot(where, mean, marker="o", markersize=3, label=f"{name} (n={len(groups[name])})")[0]
        ax.fill_between(where, mean - std, mean + std, color=line.get_color(), alpha=0.2)
    ax.set_xlabel(x or "iteration")
    ax.set_ylabel(metric)
    ax.set_title(metric)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _study_outputs(study_run, storage: str | None, out: Path) -> list[Path]:
    """Importance plot and trial table of the Optuna study behind a sweep's parent run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna

    from empo2.workflows.sweep_storage import open_storage

    name = study_run.data.tags.get("optuna.study", study_run.info.run_name)
    url = storage or study_run.data.tags.get("optuna.storage")
    if not url:
        raise ConfigError(f"study {name}: its storage is not recorded; give --storage")
    study = optuna.load_study(study_name=name, storage=open_storage(url))
    written = [out / f"trials_{_slug(name)}.csv"]
    study.trials_dataframe().to_csv(written[0], index=False)
    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    if len(complete) < 2 or len({t.value for t in complete}) < 2:
        print(f"study {name}: parameter importance needs two completed trials with different values; skipped")
        return written
    optuna.visualization.matplotlib.plot_param_importances(study)
    path = out / f"importance_{_slug(name)}.png"
    plt.gcf().tight_layout()
    plt.savefig(path, dpi=100)
    plt.close("all")
    return written + [path]

"""Evaluation of a trained policy, and the paper's memory-only adaptation to unseen tasks.

`evaluate`: score and success per task on a variation split, with the tips the run collected
(memory on), without them (off), or both; greedy-ish sampling at `rollout.val_temperature`.

`adapt`: K trials on tasks the policy never trained on (the catalogue's held-out tasks by default),
memory on and no parameter update. Trial 1 starts with an empty memory; after each trial the tips
the policy wrote about its episodes are added, so trial k sees what trials 1..k-1 taught. The
per-trial curve is the paper's out-of-distribution result.

The config is the training run's (summary.json beside the checkpoints) with `key=value` overrides
on top; a checkpoint without a summary (an interrupted run) is read with the config composed from
the overrides, as `empo2 train` composes it. Without `ckpt`, `adapt` uses the configured base model.

Each command is also an MLflow run (tag `kind` eval or adapt) in the experiment of the checkpoint's
training run, else `logger.experiment`: the config and the command's options as params, the training
run's tags, the scores as metrics (adapt: one step per trial) and the output files as artifacts.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from empo2.config import ConfigError, TrainConfig, load_config, to_dict, validate
from empo2.envs import TaskSpec, get_catalogue
from empo2.utils import atomic_write_json
from empo2.workflows.runs import run_tags, tracking_uri

# torch and Lightning (for derive_seed) are imported where used: a mistyped argument is reported in a
# second, not after the seconds those imports take

EVAL_OPTIONS = ("ckpt", "memory", "split", "variations", "rollouts", "tasks", "out")
ADAPT_OPTIONS = ("ckpt", "trials", "split", "variations", "rollouts", "tasks", "out")


def parse_kv(argv: list[str], options: tuple[str, ...]) -> tuple[dict[str, str], list[str]]:
    """Split `key=value` arguments into this command's options and config overrides."""
    opts, overrides = {}, []
    for token in argv:
        key, sep, value = token.partition("=")
        if not sep:
            raise ConfigError(f"{token!r}: expected key=value (options: {', '.join(options)}; or a config override)")
        if key in options:
            opts[key] = value
        else:
            overrides.append(token)
    return opts, overrides


def int_option(opts: dict, key: str, default: int | None) -> int | None:
    if key not in opts:
        return default
    try:
        value = int(opts[key])
    except ValueError:
        raise ConfigError(f"{key}={opts[key]!r}: expected an integer") from None
    if value < 1:
        raise ConfigError(f"{key}={value} is out of range: expected >= 1")
    return value


def resolve_checkpoint(ref: str) -> Path:
    """A .ckpt file, or a run folder / its checkpoints folder (their last.ckpt)."""
    path = Path(ref).expanduser()
    for candidate in (path, path / "last.ckpt", path / "checkpoints" / "last.ckpt"):
        if candidate.is_file():
            return candidate
    raise ConfigError(f"ckpt={ref}: no checkpoint there (expected a .ckpt file or a run folder with checkpoints/)")


def run_dir_of(ckpt: Path) -> Path:
    """The run folder a checkpoint belongs to (`<run>/checkpoints/x.ckpt`), else the file's folder."""
    return ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent


def run_config(ckpt: Path | None, overrides: list[str]) -> TrainConfig:
    """The training run's resolved config with dotted overrides on top, or, without a summary.json,
    the config composed from the overrides."""
    summary = run_dir_of(ckpt) / "summary.json" if ckpt is not None else None
    if summary is None or not summary.is_file():
        return load_config(overrides)
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from empo2.config import ENV_CONFIGS, MiniSciConfig, _one_line, config_schema, migrate_config

    for o in overrides:
        if "." not in o.partition("=")[0].lstrip("+"):
            raise ConfigError(f"{o!r}: the run's config is the base here; override single keys (env.tasks=..., "
                              "rollout.val_temperature=...), not whole groups")
    try:
        saved = migrate_config(json.loads(summary.read_text())["config"])  # a run saved under older key names
        schema = config_schema(ENV_CONFIGS.get(saved.get("env", {}).get("name"), MiniSciConfig))
        merged = OmegaConf.merge(schema, saved, OmegaConf.from_dotlist([o.lstrip("+") for o in overrides]))
        cfg: TrainConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as e:
        raise ConfigError(_one_line(e)) from None
    return validate(cfg)


def _worker(cfg: TrainConfig, ckpt: Path | None, n_envs: int, with_memory_state: bool):
    """Policy (with the checkpoint's weights) inside a rollout worker; the checkpoint's tips if asked. The policy is
    in `model.dtype`, the dtype a trained model is read in to be served: a checkpoint's float32 master weights are
    rounded to it (bfloat16 for the Qwen presets), not kept at training's float32."""
    import torch

    from empo2.lit.callbacks import worker_state
    from empo2.models import load_policy
    from empo2.rollout.build import build_worker

    model, tok = load_policy(cfg.model)
    state = torch.load(ckpt, map_location="cpu", weights_only=True) if ckpt is not None else None
    if state is not None:
        weights = {k.removeprefix("policy."): v for k, v in state["state_dict"].items() if k.startswith("policy.")}
        model.load_state_dict(weights)
    if torch.cuda.is_available() and cfg.trainer.accelerator != "cpu":
        model.to("cuda")
    model.eval()
    worker = build_worker(cfg, model, tok, n_envs)  # the engine copies the weights loaded above
    if with_memory_state:
        cb_state = next((v for k, v in state["callbacks"].items() if k.startswith("RolloutCallback")), None)
        saved = worker_state(cb_state) if cb_state is not None else {}
        if saved.get("memory") is None:
            raise ConfigError(f"ckpt={ckpt}: holds no tip memory (trained with memory.enabled=false?); use memory=off")
        worker.load_state_dict(saved)
    return worker


def task_list(cfg: TrainConfig, tasks: str | None, split: str, variations: int, held_out: bool) -> list[TaskSpec]:
    """The first `variations` variations of `split` for each task: `tasks=a,b`, else the held-out
    tasks (adapt) or the run's training tasks (eval)."""
    cat = get_catalogue(cfg.env.name)
    if tasks:
        names = [t.strip() for t in tasks.split(",") if t.strip()]
    elif held_out:
        names = list(cat.ood_tasks)
        if not names:
            raise ConfigError(f"env {cfg.env.name} holds out no tasks; name some with tasks=a,b")
    else:
        names = list(cfg.env.tasks) or cat.tasks()
    if split not in ("train", "dev", "test"):
        raise ConfigError(f"split={split!r} is not allowed: expected one of ['train', 'dev', 'test']")
    try:
        return [TaskSpec(t, v) for t in names for v in cat.split(t, split)[:variations]]
    except ValueError as e:
        raise ConfigError(f"tasks={tasks}: {e}") from None


def _play(worker, spec, tasks: list[TaskSpec], rollouts: int, iteration: int, seed: int) -> tuple[list[dict], list]:
    """Every task instance `rollouts` times as `spec` says, in chunks the worker's environments hold. Returns the
    episodes and the tip entries written (adapt adds them only after the whole trial)."""
    import torch

    from empo2.lit.data import derive_seed

    per_call = max(1, len(worker.envs) // rollouts)
    episodes, new_tips = [], []
    for c, start in enumerate(range(0, len(tasks), per_call)):
        generator = torch.Generator().manual_seed(derive_seed(seed, iteration, c))
        batch = worker.collect(spec, tasks[start:start + per_call], rollouts, iteration, generator)
        episodes += [{"task": t.task, "variation": t.variation, "score": t.score, "won": t.won, "steps": t.length,
                      "tips_retrieved": len(t.tips_used)} for t in batch.trajectories]
        if batch.new_tips is not None and batch.new_tips[0]:
            new_tips.append(batch.new_tips)
    return episodes, new_tips


def summarize(episodes: list[dict]) -> dict:
    """Mean score (0-100), success rate and tips retrieved per episode, overall and per task."""
    by_task = defaultdict(list)
    for e in episodes:
        by_task[e["task"]].append(e)

    def stats(eps):
        n = max(len(eps), 1)
        return {"score": sum(e["score"] for e in eps) / n, "success": sum(e["won"] for e in eps) / n,
                "tips_retrieved": sum(e["tips_retrieved"] for e in eps) / n, "episodes": len(eps)}

    return {**stats(episodes), "per_task": {t: stats(eps) for t, eps in sorted(by_task.items())}}


def _n_envs(cfg: TrainConfig, tasks: list, rollouts: int) -> int:
    return min(len(tasks) * rollouts, max(cfg.rollout.tasks_per_batch * cfg.rollout.group_size, rollouts))


def evaluate(cfg: TrainConfig, ckpt: Path, memory: str = "both", split: str = "test", variations: int | None = None,
             rollouts: int = 1, tasks: str | None = None, out: Path | None = None) -> dict:
    """Score a checkpoint with memory `on`, `off` or `both`; writes eval_<split>.json and .md in `out` and
    records them as an MLflow run."""
    from empo2.lit.data import derive_seed
    from empo2.rollout.spec import scoring_spec

    modes = {"on": ["mem"], "off": ["nomem"], "both": ["nomem", "mem"]}.get(memory)
    if modes is None:
        raise ConfigError(f"memory={memory!r} is not allowed: expected on, off or both")
    task_specs = task_list(cfg, tasks, split, variations or cfg.env.val_variations, held_out=False)
    worker = _worker(cfg, ckpt, _n_envs(cfg, task_specs, rollouts), with_memory_state="mem" in modes)
    results = {}
    try:
        for mode in modes:
            episodes, _ = _play(worker, scoring_spec(cfg, mem=mode == "mem"), task_specs, rollouts, 0,
                                derive_seed(cfg.seed, 2**22, mode == "mem"))
            results[mode] = {**summarize(episodes), "episodes_detail": episodes}
    finally:
        for env in worker.envs:
            env.close()
    out = Path(out or run_dir_of(ckpt) / "eval")
    report = {"checkpoint": str(ckpt), "split": split, "rollouts": rollouts, "modes": results, "config": to_dict(cfg)}
    # every mode plays the same episodes per task, so one count per row says what each cell averages
    head = ["task", "episodes"] + [f"{col} ({m})" for m in modes for col in ("score", "success")]
    first = results[modes[0]]
    rows = [[t, str(first["per_task"][t]["episodes"])]
            + [f"{results[m]['per_task'][t][c]:.3g}" for m in modes for c in ("score", "success")]
            for t in first["per_task"]]
    rows.append(["**all**", str(first["episodes"])]
                + [f"{results[m][c]:.3g}" for m in modes for c in ("score", "success")])
    result = _write(out, f"eval_{split}", report, _table(head, rows))
    metrics = [row for m in modes for row in _score_metrics("eval", results[m], m, 0)]
    options = {"memory": memory, "split": split, "variations": variations or cfg.env.val_variations,
               "rollouts": rollouts, "tasks": ",".join(first["per_task"]), "checkpoint": str(ckpt)}
    result["mlflow_run_id"] = record_run(cfg, ckpt, "eval", options, metrics,
                                         [result["json"], result["table"]], f"{run_dir_of(ckpt).name}-eval-{split}")
    return result


def adapt(cfg: TrainConfig, ckpt: Path | None = None, trials: int = 3, split: str = "test",
          variations: int | None = None, rollouts: int = 1, tasks: str | None = None, out: Path | None = None) -> dict:
    """K memory-only trials on unseen tasks, each beside the same episodes played tip-free; writes adapt.json,
    adapt.md and adapt_curve.png in `out` and records them as an MLflow run."""
    from empo2.lit.data import derive_seed
    from empo2.rollout.spec import adaptation_spec, scoring_spec

    cfg.memory.enabled = True  # the memory is the whole point: a run trained without one adapts with a fresh one
    task_specs = task_list(cfg, tasks, split, variations or cfg.env.val_variations, held_out=True)
    worker = _worker(cfg, ckpt, _n_envs(cfg, task_specs, rollouts), with_memory_state=False)
    trial, nomem_spec = adaptation_spec(cfg), scoring_spec(cfg, mem=False)
    per_trial = []
    try:
        for k in range(1, trials + 1):
            seed = derive_seed(cfg.seed, 2**23)
            episodes, new_tips = _play(worker, trial, task_specs, rollouts, k, seed)
            # the same instances and seeds without tips: what the trial's memory adds, trial by trial
            nomem, _ = _play(worker, nomem_spec, task_specs, rollouts, k, seed)
            for entries in new_tips:  # after the trial, so no episode saw its own trial's tips
                worker.memory.add(*entries)
            per_trial.append({"trial": k, **summarize(episodes), "memory_size": len(worker.memory),
                              "nomem": summarize(nomem)})
            t = per_trial[-1]
            print(f"trial {k}: score {t['score']:.1f} (tip-free {t['nomem']['score']:.1f}), success "
                  f"{t['success']:.2f} (tip-free {t['nomem']['success']:.2f}), {t['tips_retrieved']:.1f} tips "
                  f"retrieved per episode, {t['memory_size']} in memory")
    finally:
        for env in worker.envs:
            env.close()
    out = Path(out or (run_dir_of(ckpt) if ckpt is not None else Path(cfg.run_root)) / "adapt")
    report = {"checkpoint": str(ckpt) if ckpt else None, "split": split, "rollouts": rollouts,
              "tasks": sorted({t.task for t in task_specs}), "trials": per_trial, "config": to_dict(cfg)}
    rows = [[str(t["trial"]), str(t["episodes"]), f"{t['score']:.3g}", f"{t['success']:.3g}",
             f"{t['nomem']['score']:.3g}", f"{t['nomem']['success']:.3g}", f"{t['tips_retrieved']:.3g}",
             str(t["memory_size"])] for t in per_trial]
    head = ["trial", "episodes", "score", "success", "score (tip-free)", "success (tip-free)",
            "tips retrieved / episode", "tips in memory"]
    result = _write(out, "adapt", report, _table(head, rows))
    result["curve"] = str(_plot_trials(per_trial, out / "adapt_curve.png"))
    metrics = []
    for t in per_trial:
        k = t["trial"]
        metrics += [*_score_metrics("adapt", t, "mem", k), *_score_metrics("adapt", t["nomem"], "nomem", k),
                    ("adapt/tips_retrieved", t["tips_retrieved"], k), ("adapt/memory_size", t["memory_size"], k)]
    options = {"trials": trials, "split": split, "variations": variations or cfg.env.val_variations,
               "rollouts": rollouts, "tasks": ",".join(report["tasks"]), "checkpoint": str(ckpt) if ckpt else None}
    source = run_dir_of(ckpt).name if ckpt is not None else cfg.model.name
    result["mlflow_run_id"] = record_run(cfg, ckpt, "adapt", options, metrics,
                                         [result["json"], result["table"], result["curve"]], f"{source}-adapt-{split}")
    return result


def _score_metrics(kind: str, summary: dict, mode: str, step: int) -> list[tuple[str, float, int]]:
    """(key, value, step) of a `summarize` result: `<kind>/score_<mode>`, `<kind>/success_<mode>`, and the
    same per task, `<kind>/<task>/score_<mode>`."""
    rows = [(f"{kind}/{c}_{mode}", summary[c], step) for c in ("score", "success")]
    return rows + [(f"{kind}/{task}/{c}_{mode}", st[c], step) for task, st in summary["per_task"].items()
                   for c in ("score", "success")]


def _source_run(ckpt: Path | None) -> tuple[str | None, str | None]:
    """(MLflow run id, tracking URI) of the training run a checkpoint comes from, as far as its folder says."""
    if ckpt is None:
        return None, None
    run_dir = run_dir_of(ckpt)
    if (run_dir / "summary.json").is_file():
        summary = json.loads((run_dir / "summary.json").read_text())
        return summary.get("mlflow_run_id"), summary.get("mlflow_tracking_uri")
    id_file = run_dir / "mlflow_run_id.txt"  # an interrupted run
    return (id_file.read_text().strip() or None, None) if id_file.is_file() else (None, None)


def record_run(cfg: TrainConfig, ckpt: Path | None, kind: str, options: dict, metrics: list[tuple[str, float, int]],
               files: list[str], name: str) -> str | None:
    """The MLflow run of an eval or adapt (see the module doc); its id, or None with `logger=none` or when
    the tracking store cannot be reached (said in one line: the files stay where they were written)."""
    if cfg.logger.name == "none":
        return None
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from empo2.workflows.tracking import experiment_id, first_line, quick_requests, upload

    source_id, source_uri = _source_run(ckpt)
    # a tracking URI given for this command wins; else the training run's (absolute) one
    uri = cfg.logger.tracking_uri or source_uri or tracking_uri(cfg)
    tags = run_tags(cfg, kind)
    if source_id:
        tags["source_run"] = source_id
    try:
        with quick_requests():
            if uri.startswith("sqlite:///"):
                Path(uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
            client = MlflowClient(uri)
            exp_id = None
            if source_id:
                try:
                    exp_id = client.get_run(source_id).info.experiment_id
                except MlflowException:  # the training run is not in this store
                    pass
            run_id = client.create_run(exp_id or experiment_id(client, cfg.logger.experiment), run_name=name,
                                       tags=tags).info.run_id
            upload(client, run_id, config={**to_dict(cfg), kind: options}, metrics=metrics, files=files)
            client.set_terminated(run_id)
    except Exception as e:
        print(f"could not record the {kind} as an MLflow run in {uri} ({first_line(e)}); its files stay in "
              f"{Path(files[0]).parent}")
        return None
    print(f"MLflow run {run_id} ({kind}) in {uri}")
    return run_id


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def _write(out: Path, stem: str, report: dict, table: str) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / f"{stem}.json", report)
    (out / f"{stem}.md").write_text(table)
    print(table, end="")
    return {**report, "json": str(out / f"{stem}.json"), "table": str(out / f"{stem}.md")}


def _plot_trials(per_trial: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trials = [t["trial"] for t in per_trial]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(trials, [t["score"] for t in per_trial], marker="o", label="score (0-100)")
    ax.plot(trials, [t["nomem"]["score"] for t in per_trial], marker="o", linestyle="--", color="tab:gray",
            label="score, same episodes tip-free")
    ax.set_xlabel("trial (memory only, no parameter update)")
    ax.set_ylabel("score")
    ax2 = ax.twinx()
    ax2.plot(trials, [t["success"] for t in per_trial], marker="s", color="tab:orange", label="success")
    ax2.set_ylabel("success rate")
    ax2.set_ylim(-0.05, 1.05)
    fig.legend(loc="upper left", fontsize=7)
    ax.set_xticks(trials)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

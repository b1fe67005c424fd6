"""`empo2 grid`: every preset x seed of a grid file, in local worker processes or as SLURM jobs (slurm.py).

A grid file (grids/ablations.yaml) lists presets of experiments/ and the overrides shared by all runs:

    name: ablations                 # grid id: run folders <run_root>/<name>/<preset>-s<seed>, MLflow tag `grid`
    mlflow_experiment: empo2-ablations   # one MLflow experiment for the whole grid (default: name)
    presets: [empo2_paper, grpo]
    seeds: 3                        # a count (seeds 0..n-1) or a list; `--seeds` replaces it
    overrides: []                   # after each preset's, before the command line's

Each run is `empo2 train experiment=<preset> seed=<s> ...` in its own process, tagged in MLflow
with `preset`, `seed` and `grid`. A run whose folder holds a summary.json is finished and skipped,
so running the same grid again resumes it; an interrupted run continues from its last checkpoint
(`resume=auto`). Every run's config is composed and validated before the first one starts. With
`--launcher slurm` each unfinished run is one job; `--status` reads each run's state from its folder and
from the scheduler.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from empo2.config import ConfigError, TrainConfig, migrate_config, to_dict
from empo2.config.experiments import check_keys, read_yaml, string_list
from empo2.workflows.launch import WorkerPool, hydra_quote, last_line, load_run_config, log_run_files
from empo2.workflows.runs import tracking_uri
from empo2.workflows.slurm import (
    ENDED,
    SlurmConfig,
    check_cluster,
    ended_jobs,
    load_slurm_config,
    run_overrides,
    split_overrides,
    squeue_states,
    submit,
)

GRID_KEYS = ("name", "mlflow_experiment", "presets", "seeds", "overrides")


@dataclass
class GridRun:
    preset: str
    seed: int
    overrides: list[str]  # the `empo2 train` arguments of this run
    cfg: TrainConfig

    @property
    def label(self) -> str:
        return f"{self.preset} seed {self.seed}"

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.run_root).expanduser() / self.cfg.run_name


def parse_seeds(value: object, where: str) -> list[int]:
    """`3` -> [0, 1, 2]; `[0, 5]` or "0,5" -> those seeds."""
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",") if p.strip()]
        value = int(parts[0]) if len(parts) == 1 and parts[0].isdigit() else parts
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a count or a list of seeds, got {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise ConfigError(f"{where}={value} is out of range: expected a count >= 1 or a list of seeds")
        return list(range(value))
    try:
        seeds = [int(s) for s in value]  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: expected a count or a list of seeds, got {value!r}") from None
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise ConfigError(f"{where}: expected distinct seeds >= 0, got {seeds}")
    return seeds


def plan_grid(path: str | Path, seeds: object = None, overrides: list[str] | tuple = ()) -> tuple[str, list[GridRun]]:
    """The grid's id and its runs, each with a validated config. Any problem raises `ConfigError`
    naming the file (or the preset and seed) before anything runs."""
    path = Path(path)
    moved = path.parent.parent / "grids" / path.name  # experiments/X.yaml -> grids/X.yaml, where grid files live now
    if not path.exists() and moved != path and moved.is_file():
        raise ConfigError(f"grid file {path}: no such file; it moved to {moved}")
    data = read_yaml(path, "grid file")
    check_keys(data, GRID_KEYS, path)
    presets = string_list(data.get("presets"), "presets", path)
    if not presets:
        raise ConfigError(f"{path}: presets is empty or missing")
    grid_id = str(data.get("name") or path.stem)
    experiment = str(data.get("mlflow_experiment") or grid_id)
    seed_list = parse_seeds(seeds if seeds is not None else data.get("seeds", 1),
                            "--seeds" if seeds is not None else f"{path}: seeds")
    shared = string_list(data.get("overrides"), "overrides", path) + list(overrides)
    runs = []
    for preset in presets:
        for seed in seed_list:
            args = [f"experiment={preset}", *shared, f"seed={seed}", f"run_name={grid_id}/{preset}-s{seed}",
                    f"++logger.experiment={hydra_quote(experiment)}", f"+logger.tags.grid={hydra_quote(grid_id)}",
                    f"+logger.tags.seed={hydra_quote(seed)}", "resume=auto"]
            cfg = load_run_config(args, f"{path}: {preset} seed {seed}", "grid runs")
            runs.append(GridRun(preset, seed, args, cfg))
    return grid_id, runs


# Settings that change no result, so a finished run is the grid's whatever it had: the preset's description (runs
# before it had none), and how the update holds its memory (the laptop defaults: the same math to float32 rounding)
RESULT_NEUTRAL = ("description", "trainer.gradient_checkpointing", "trainer.micro_batch_tokens",
                  "trainer.release_memory")


def is_finished(run: GridRun) -> bool:
    """A run is finished when its summary.json exists; one written under another config is an error,
    since skipping it would silently mix two settings in one grid."""
    summary_path = run.run_dir / "summary.json"
    if not summary_path.is_file():
        return False
    saved = migrate_config(json.loads(summary_path.read_text()).get("config", {}))  # saved under older key names
    wanted = json.loads(json.dumps(to_dict(run.cfg), default=str))
    for config in (saved, wanted):
        for key in RESULT_NEUTRAL:
            group, _, name = key.rpartition(".")
            (config.get(group, {}) if group else config).pop(name, None)
    diff = _first_difference(saved, wanted)
    if diff:
        raise ConfigError(f"{run.label}: {run.run_dir} finished with {diff}; give the grid another name or "
                          "remove that folder")
    return True


def _first_difference(saved: dict, wanted: dict, prefix: str = "") -> str | None:
    for key in sorted(set(saved) | set(wanted)):
        a, b = saved.get(key), wanted.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            found = _first_difference(a, b, f"{prefix}{key}.")
            if found:
                return found
        elif a != b:
            return f"{prefix}{key}={a!r} (this grid wants {b!r})"
    return None


def _prepare_tracking(runs: list[GridRun]) -> None:
    """Create the MLflow database and experiment once, here: worker processes that all start on a
    fresh sqlite file would race to create its tables."""
    from mlflow.tracking import MlflowClient

    from empo2.workflows.tracking import experiment_id

    for uri, name in sorted({(tracking_uri(r.cfg), r.cfg.logger.experiment) for r in runs}):
        if uri.startswith("sqlite:///"):
            Path(uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
        experiment_id(MlflowClient(uri), name)


def run_grid(path: str | Path, seeds: object = None, workers: int = 1, overrides: list[str] | tuple = (),
             launcher: str = "local") -> list[dict]:
    """Run (or resume) a grid; returns one record per run: preset, seed, status
    (`finished` | `skipped` | `failed`), run_dir and log. `launcher="slurm"`: each run is a SLURM job
    (`launcher.*` overrides set its resources) and `workers` is not used."""
    if launcher == "slurm":
        return _run_grid_slurm(path, seeds, overrides)
    grid_id, runs = plan_grid(path, seeds, overrides)
    todo = [r for r in runs if not is_finished(r)]
    records = _records(runs)
    print(f"grid {grid_id}: {len(runs)} runs, {len(runs) - len(todo)} already finished, "
          f"{len(todo)} to run with {workers} worker{'s' if workers > 1 else ''}")
    if todo:
        _prepare_tracking(todo)
    with WorkerPool(workers) as pool:
        queue = list(todo)
        while queue or pool.jobs:
            while queue and pool.free:
                run = queue.pop(0)
                log = run.run_dir / "worker.log"
                pool.start(run, "empo2.cli", ["train", *run.overrides], log)
                print(f"  {run.label}: started (log {log})")
            run, rc, log = pool.wait()
            _record_end(run, records, rc == 0, log, f"exit {rc}")
    return [records[(r.preset, r.seed)] for r in runs]


def _records(runs: list[GridRun]) -> dict:
    return {(r.preset, r.seed): {"preset": r.preset, "seed": r.seed, "status": "skipped", "run_dir": str(r.run_dir),
                                 "log": None} for r in runs}


def _record_end(run: GridRun, records: dict, ok: bool, log: Path, how: str, job: str = "") -> None:
    """A run's process or job has ended: finished only with its summary.json (then its files go to MLflow)."""
    ok = ok and (run.run_dir / "summary.json").is_file()
    if ok:
        log_run_files(json.loads((run.run_dir / "summary.json").read_text()))
    records[(run.preset, run.seed)].update(status="finished" if ok else "failed", log=str(log))
    print(f"  {run.label}: " + (f"finished{job}" if ok else f"failed ({how}): {last_line(log)}"))


def _plan_slurm(path: str | Path, seeds: object, overrides: list[str] | tuple) -> tuple[SlurmConfig, str, list]:
    ours, rest = split_overrides(overrides)
    slurm = load_slurm_config(ours)
    return (slurm, *plan_grid(path, seeds, [*rest, *run_overrides(slurm)]))


def _run_grid_slurm(path: str | Path, seeds: object, overrides: list[str] | tuple) -> list[dict]:
    """Every unfinished run as one SLURM job (its id kept in `<run_dir>/slurm_job`), then wait for them all."""
    slurm, grid_id, runs = _plan_slurm(path, seeds, overrides)
    todo = [r for r in runs if not is_finished(r)]
    records = _records(runs)
    check_cluster(slurm)
    print(f"grid {grid_id}: {len(runs)} runs, {len(runs) - len(todo)} already finished, "
          f"{len(todo)} to submit to SLURM")
    if todo:
        _prepare_tracking(todo)
    jobs = {}
    for run in todo:
        log = run.run_dir / "worker.log"
        job_id = submit(slurm, f"{grid_id}/{run.preset}-s{run.seed}", "empo2.cli", ["train", *run.overrides], log,
                        run.run_dir / "slurm")
        (run.run_dir / "slurm_job").write_text(job_id + "\n")
        jobs[job_id] = run
        print(f"  {run.label}: SLURM job {job_id} (log {log})")
    for job_id, state in ended_jobs(list(jobs)):
        run = jobs[job_id]
        _record_end(run, records, state in ("completed", "ended"), run.run_dir / "worker.log",
                    f"SLURM job {job_id} {state}", job=f" (SLURM job {job_id})")
    return [records[(r.preset, r.seed)] for r in runs]


def grid_status(path: str | Path, seeds: object = None, overrides: list[str] | tuple = ()) -> list[dict]:
    """Each run's state from its folder and the scheduler: `finished` (summary.json), `queued` or `running`
    (its SLURM job, per squeue), `failed` (it started, its job is gone, no summary) or `not started`."""
    _, _, runs = _plan_slurm(path, seeds, overrides)
    ids = {r.label: (r.run_dir / "slurm_job").read_text().strip() for r in runs
           if (r.run_dir / "slurm_job").is_file()}
    states = squeue_states(sorted(set(ids.values())))
    rows = []
    for r in runs:
        job_id = ids.get(r.label)
        state = states.get(job_id, "") if job_id else ""
        if (r.run_dir / "summary.json").is_file():
            status = "finished"
        elif state and state not in ENDED:
            status = "queued" if state in ("PENDING", "REQUEUED", "CONFIGURING") else "running"
        elif (r.run_dir / "worker.log").is_file():
            status = "failed"
        else:
            status = "not started"
        rows.append({"preset": r.preset, "seed": r.seed, "status": status, "job": job_id,
                     "scheduler": state.lower() or None, "run_dir": str(r.run_dir)})
    return rows

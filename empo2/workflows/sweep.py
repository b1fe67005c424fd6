"""`empo2 sweep`: a native Optuna study over any config keys, each trial a training run in its own process.

The sweep file (format in sweep_spec.py, examples in sweeps/) names the study, its search space and
settings. The driver asks the study for a trial and starts
`python -m empo2.workflows.sweep_trial <study> <n> <overrides>` (so DDP/FSDP trials launch their ranks as
`empo2 train` does, each worker on its own GPUs); the trial process reports the metric to the shared
RDB storage after each validation, stops when the median pruner says so, and tells the study its
result. An MLflow parent run stands for the study; every trial's run is nested under it.

Several drivers, on several hosts, started in any order, work on one study through a PostgreSQL/MySQL
storage (sweep_storage.py: every once-per-study step runs under a database lock). `n_trials` is the
study's total, shared by all of them: a driver starts a trial only while the study holds fewer than
`n_trials` running or finished ones. The driver and the trial process both record the trial's
heartbeat; a trial whose heartbeat stops (its worker was killed, its node lost) is marked FAIL by
whichever driver notices first and re-queued (at most `heartbeat.max_retry` times), and the failed
copy no longer counts. A driver with nothing left to start waits until the other drivers' trials end
(taking over any that go stale), so every driver ends with the finished study; the best parameters
are then printed and written once as a preset file (`<run_root>/<study>/best.yaml`) that
`empo2 train experiment=<that file>` accepts.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from empo2.config import ConfigError
from empo2.config.experiments import preset_config, preset_text
from empo2.workflows.launch import WorkerPool, hydra_quote, last_line
from empo2.workflows.runs import check_tracking, tracking_uri
from empo2.workflows.slurm import (
    PREFIX,
    SlurmConfig,
    check_cluster,
    ended_jobs,
    load_slurm_config,
    split_overrides,
    submit,
)
from empo2.workflows.sweep_spec import Param, SweepSpec, load_sweep, make_pruner, make_sampler
from empo2.workflows.sweep_storage import open_storage, shown_url, storage_lock

__all__ = ["STORAGE_ENV", "Param", "SweepSpec", "load_sweep", "make_pruner", "make_sampler", "open_storage",
           "run_sweep"]
# the storage URL reaches trial processes and SLURM worker jobs here, never on a command line
STORAGE_ENV = "EMPO2_SWEEP_STORAGE"


def _parent_run(study, spec: SweepSpec, storage_url: str) -> str:
    """The study's MLflow parent run: created once and remembered in the study itself, so a continued
    study, or a driver on another host, nests its trials under the same run."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from empo2.workflows.tracking import experiment_id

    uri = tracking_uri(spec.cfg)
    if uri.startswith("sqlite:///"):
        Path(uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    client = MlflowClient(uri)  # creates a new sqlite database here, before trial processes could race to
    run_id = study.user_attrs.get("mlflow_parent_run_id")
    if run_id:
        try:
            client.update_run(run_id, status="RUNNING")
            return run_id
        except MlflowException:
            pass  # the study outlived its tracking database: start a new parent run
    exp_id = experiment_id(client, spec.mlflow_experiment)
    tags = {"empo2.role": "study", "optuna.study": spec.study, "optuna.metric": spec.metric,
            "optuna.storage": shown_url(storage_url)}
    run_id = client.create_run(exp_id, run_name=spec.study, tags=tags).info.run_id
    study.set_user_attr("mlflow_parent_run_id", run_id)
    return run_id


def _open_study(spec: SweepSpec, storage_url: str):
    """Create the study, or load it to continue; its settings must match the file's. Runs under the
    study lock, so drivers starting at the same instant create one study, enqueue its first trials
    once and share one MLflow parent run. Returns (study, storage, parent run id)."""
    import optuna

    storage = open_storage(storage_url, spec.heartbeat)
    with storage_lock(storage.url):
        study = optuna.create_study(study_name=spec.study, storage=storage, direction=spec.direction,
                                    load_if_exists=True)
        if study.direction.name.lower() != spec.direction:
            raise ConfigError(f"{spec.path}: study {spec.study} exists with direction "
                              f"{study.direction.name.lower()}; this file says {spec.direction}")
        attrs = study.user_attrs
        known = attrs.get("metric")
        if known is not None and known != spec.metric:
            raise ConfigError(f"{spec.path}: study {spec.study} optimises {known}; this file says {spec.metric}")
        space = {p.key: p.record() for p in spec.space}
        if attrs.get("space") is not None and attrs["space"] != space:
            raise ConfigError(f"{spec.path}: study {spec.study} was created with another search space "
                              f"({_space_change(attrs['space'], space)}); its {len(study.trials)} trials are "
                              "kept as they are: give this search a new study name, or restore the space")
        if not study.trials:
            for params in spec.enqueue:
                study.enqueue_trial(params)
        for key, value in (("metric", spec.metric), ("pruner", spec.pruner), ("space", space),
                           ("heartbeat", spec.heartbeat)):
            if attrs.get(key) != value:
                study.set_user_attr(key, value)
        parent = _parent_run(study, spec, storage_url)
    return study, storage, parent


def _space_change(old: dict, new: dict) -> str:
    """The first differences between two search spaces, in words."""
    parts = [f"{k} added" for k in new if k not in old] + [f"{k} removed" for k in old if k not in new]
    parts += [f"{k}: {old[k]} -> {new[k]}" for k in new if k in old and old[k] != new[k]]
    return "; ".join(parts[:3]) + ("; ..." if len(parts) > 3 else "")


def _write_best(study, spec: SweepSpec, path: Path) -> dict:
    """The best trial as a preset file: built on the sweep's preset, with its fixed overrides, then its parameters."""
    best = study.best_trial
    params = {p.key: best.params[p.key] for p in spec.space if p.key in best.params}
    lines = [p.override(params[p.key]) for p in spec.space if p.key in params]
    description = f"best trial {best.number} of Optuna study {spec.study}: {spec.metric} = {best.value:.6g}"
    comment = (f"# Best trial {best.number} of Optuna study {spec.study!r}: {spec.metric} = {best.value:.6g} "
               f"({spec.direction}).\n# Train with it: empo2 train experiment={path}\n")
    text = preset_text(preset_config([spec.preset] if spec.preset else [], spec.fixed + lines, description), comment)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)  # whole or not at all: a reader never sees half a file
    return {"number": best.number, "value": best.value, "params": params}


def _replaced(trials) -> set[int]:
    """Numbers of the FAIL trials that were re-queued after their heartbeat stopped: a retry stands for
    each, so they no longer count toward n_trials."""
    return {n for t in trials for n in t.system_attrs.get("retry_history", ())}


def _counted(trials) -> int:
    """Trials that use up the study's n_trials: running or finished, less the re-queued failures."""
    import optuna

    State = optuna.trial.TrialState
    replaced = _replaced(trials)
    return sum(1 for t in trials if t.state in (State.RUNNING, State.COMPLETE, State.PRUNED, State.FAIL)
               and t.number not in replaced)


def run_sweep(path: str | Path, workers: int = 1, overrides: list[str] | tuple = (), n_trials: int | None = None,
              timeout: float | None = None, storage: str | None = None, launcher: str = "local") -> dict:
    """Run (or continue) a study until it holds `n_trials` finished trials or `timeout` seconds have
    passed. Returns the study name, storage, counts per state, the best trial and the best-file path.
    Any number of these drivers, on any hosts, may run at once on one shared storage. `launcher="slurm"`:
    `workers` drivers run as SLURM jobs (`launcher.*` overrides set their resources); this one creates the
    study, waits for them and reports the result."""
    import optuna

    slurm = None
    if launcher == "slurm":
        ours, overrides = split_overrides(overrides)
        slurm = load_slurm_config(ours)
        if slurm.nodes > 1 or slurm.tasks_per_node not in (None, 1):
            key = "nodes" if slurm.nodes > 1 else "tasks_per_node"
            raise ConfigError(f"{PREFIX}{key}={getattr(slurm, key)} is not allowed for a sweep: each worker job runs "
                              "its trials on one node, their ranks started by trainer.devices (and its GPUs by "
                              f"{PREFIX}gpus_per_node)")
        if workers < 1:
            raise ConfigError(f"--workers={workers} is out of range: expected >= 1")
    spec = load_sweep(path, overrides)
    n_trials = spec.n_trials if n_trials is None else n_trials
    timeout = spec.timeout if timeout is None else timeout
    if n_trials < 1:
        raise ConfigError(f"--n-trials={n_trials} is out of range: expected >= 1")
    root = Path(spec.cfg.run_root).expanduser().resolve()
    url = storage or os.environ.get(STORAGE_ENV) or spec.storage or f"sqlite:///{root / 'optuna.db'}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the driver prints its own lines

    if not tracking_uri(spec.cfg).startswith("sqlite:"):  # a tracking server that is down: one line, now
        check_tracking(spec.cfg)
    if slurm is not None:
        check_cluster(slurm)
    study, rdb, parent = _open_study(spec, url)
    State = optuna.trial.TrialState
    done_states = (State.COMPLETE, State.PRUNED, State.FAIL)
    trials = study.get_trials(deepcopy=False)
    n_done = sum(1 for t in trials if t.state in done_states and t.number not in _replaced(trials))
    print(f"study {spec.study}: {n_done} of {n_trials} trials finished; storage "
          f"{url if url.startswith('sqlite') else shown_url(url)}")
    if slurm is None:
        _run_trials(study, rdb, spec, root, workers, n_trials, timeout)
    else:
        args = ["sweep", str(Path(path).resolve()), "--n-trials", str(n_trials), *overrides]
        _run_worker_jobs(slurm, spec, root, url, workers, args + (["--timeout", str(timeout)] if timeout else []))

    trials = study.get_trials(deepcopy=False)
    counts = {s.name.lower(): sum(1 for t in trials if t.state == s) for s in done_states}
    result = {"study": spec.study, "storage": url, "counts": counts, "retried": sorted(_replaced(trials)),
              "best": None, "best_file": None, "best_written": False, "mlflow_parent_run_id": parent}
    if counts["complete"]:
        best_file = root / spec.study / "best.yaml"
        with storage_lock(rdb.url):  # several drivers end together: one of them writes the file
            best = study.best_trial
            stamp = f"trial {best.number} of {len(trials)}"
            if study.user_attrs.get("best_written") != stamp or not best_file.is_file():
                result["best"] = _write_best(study, spec, best_file)
                study.set_user_attr("best_written", stamp)
                result["best_written"] = True
            else:
                params = {p.key: best.params[p.key] for p in spec.space if p.key in best.params}
                result["best"] = {"number": best.number, "value": best.value, "params": params}
        result["best_file"] = str(best_file)
        print(f"best trial {result['best']['number']}: {spec.metric} = {result['best']['value']:.6g}")
        for key, value in result["best"]["params"].items():
            print(f"  {key} = {value}")
        print(f"{'written' if result['best_written'] else 'already written (unchanged)'} {best_file}; "
              f"train with it: empo2 train experiment={best_file}")
    else:
        print("no trial completed yet: no best parameters")
    _close_parent(spec, parent, result)
    return result


def _run_trials(study, storage, spec: SweepSpec, root: Path, workers: int, n_trials: int,
                timeout: float | None) -> None:
    """Keep `workers` trial processes busy until the study holds `n_trials` running or finished trials
    (counting every driver's), or the timeout passes; then wait for the other drivers' trials, taking
    over any whose heartbeat stops. A trial whose process ends without telling the study (a crash,
    Ctrl-C) is FAIL, and not retried: the same error would come again."""
    import warnings

    import optuna

    State = optuna.trial.TrialState
    url = storage.url
    interval = spec.heartbeat["interval"]
    ids: dict[int, int] = {}  # this driver's trials: number -> trial id
    t0 = time.monotonic()
    waiting_said = False

    def fail_if_running(number: int) -> bool:
        if study.get_trials(deepcopy=False)[number].state == State.RUNNING:
            study.tell(number, state=State.FAIL)
            return True
        return False

    def beat() -> None:
        for number in [j.key for j in pool.jobs]:
            try:
                storage.record_heartbeat(ids[number])
            except Exception as e:  # the database is briefly away: the grace period covers a missed beat
                print(f"  trial {number}: heartbeat not recorded ({type(e).__name__}); retrying")

    def take_over_stale() -> None:
        """Mark other drivers' silent trials FAIL (their retry is queued by the storage's callback)."""
        before = {t.number for t in study.get_trials(deepcopy=False, states=(State.RUNNING,))} - set(ids)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optuna.storages.fail_stale_trials(study)
        trials = study.get_trials(deepcopy=False)
        for number in sorted(before):
            if trials[number].state == State.FAIL:
                retry = [t.number for t in trials if number in t.system_attrs.get("retry_history", ())]
                print(f"  trial {number}: no heartbeat for {spec.heartbeat['grace_period']} s (its worker is gone): "
                      f"failed; " + (f"re-queued as trial {retry[0]}" if retry else "retries used up"))

    try:
        with WorkerPool(workers) as pool:
            while True:
                with storage_lock(url):  # counting and asking at once: drivers never overshoot n_trials
                    take_over_stale()  # under the lock too: one driver fails (and reports) a lost trial
                    while pool.free and (timeout is None or time.monotonic() - t0 < timeout):
                        if _counted(study.get_trials(deepcopy=False)) >= n_trials:
                            break
                        # reseeded per trial: a continued study does not replay the first trials' draws
                        study.sampler = make_sampler(spec.sampler, spec.seed + len(study.get_trials(deepcopy=False)))
                        with warnings.catch_warnings():
                            warnings.filterwarnings("ignore", message="Heartbeat of storage")
                            trial = study.ask()
                        ids[trial.number] = trial._trial_id
                        storage.record_heartbeat(trial._trial_id)  # alive from now on, while the process starts
                        values = {p.key: p.suggest(trial) for p in spec.space}
                        args = [spec.study, str(trial.number), *spec.base,
                                *(p.override(values[p.key]) for p in spec.space),
                                f"run_name={spec.study}/trial-{trial.number:04d}",
                                f"++logger.experiment={hydra_quote(spec.mlflow_experiment)}"]
                        log = root / spec.study / f"trial-{trial.number:04d}" / "worker.log"
                        pool.start(trial.number, "empo2.workflows.sweep_trial", args, log, env={STORAGE_ENV: url})
                        retried = storage.get_trial_system_attrs(trial._trial_id).get("failed_trial")
                        print(f"  trial {trial.number}: started {values}"
                              + (f" (retry of trial {retried})" if retried is not None else ""))
                if pool.jobs:
                    beat()
                    done = pool.wait(timeout=interval)
                    if done is None:
                        continue
                    number, rc, log = done
                    if fail_if_running(number):
                        print(f"  trial {number}: failed (exit {rc}): {last_line(log)}")
                    else:
                        frozen = study.get_trials(deepcopy=False)[number]
                        value = "" if frozen.value is None else f" {spec.metric} = {frozen.value:.6g}"
                        print(f"  trial {number}: {frozen.state.name.lower()}{value}")
                    continue
                trials = study.get_trials(deepcopy=False)
                others = [t.number for t in trials if t.state == State.RUNNING]
                timed_out = timeout is not None and time.monotonic() - t0 >= timeout
                if timed_out or not others and _counted(trials) >= n_trials:
                    break
                if not others:
                    continue  # a trial was re-queued meanwhile: ask for it
                if not waiting_said:
                    print(f"  waiting for trials {others} of other workers (taken over if their heartbeat stops)")
                    waiting_said = True
                time.sleep(interval)
    finally:  # after an interruption the pool has stopped the processes; their trials must not stay RUNNING
        for number in ids:
            fail_if_running(number)


def _run_worker_jobs(slurm: SlurmConfig, spec: SweepSpec, root: Path, url: str, workers: int, args: list[str]) -> None:
    """`workers` SLURM jobs, each an `empo2 sweep` driver with one worker process on the same study (its storage
    URL passed in the job's environment, never on its command line); returns when they have all ended. A job is
    one task, the driver, whatever GPUs it holds: Lightning's own launcher starts a trial's ranks (trainer.devices)
    inside it."""
    jobs = {}
    for i in range(workers):
        log = root / spec.study / f"worker-{i}.log"
        job_id = submit(slurm, f"{spec.study}/worker-{i}", "empo2.cli", args, log, root / spec.study / "slurm",
                        env={STORAGE_ENV: url}, tasks=1)
        jobs[job_id] = (i, log)
        print(f"  worker {i}: SLURM job {job_id} (log {log})")
    for job_id, state in ended_jobs(list(jobs)):
        i, log = jobs[job_id]
        print(f"  worker {i}: SLURM job {job_id} {state}" + ("" if state in ("completed", "ended")
                                                             else f": {last_line(log)}"))


def _close_parent(spec: SweepSpec, run_id: str, result: dict) -> None:
    """Best value and parameters onto the parent run (as tags: a continued study may change them,
    and MLflow params cannot change), then mark it finished."""
    from mlflow.tracking import MlflowClient


    client = MlflowClient(tracking_uri(spec.cfg))
    try:
        for state, n in result["counts"].items():
            client.set_tag(run_id, f"optuna.n_{state}", str(n))
        if result["best"]:
            client.set_tag(run_id, "optuna.best_trial", str(result["best"]["number"]))
            client.log_metric(run_id, "best_value", result["best"]["value"], step=sum(result["counts"].values()))
            for key, value in result["best"]["params"].items():
                client.set_tag(run_id, f"best.{key}", str(value))
        client.set_terminated(run_id)
    except Exception as e:  # the tracking server went away: the study and best.yaml are stored regardless
        from empo2.workflows.tracking import first_line

        print(f"the study's MLflow parent run {run_id} was not updated ({first_line(e)}); the study and best.yaml "
              "are stored, and the next `empo2 sweep` of this study updates it")

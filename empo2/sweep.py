"""`empo2 sweep`: a native Optuna study over any config keys, each trial a training run in its own process.

A sweep file (sweeps/*.yaml) holds the study settings and the search space:

    study: empo2-minisci            # Optuna study name; running the same name again continues it
    preset: empo2_paper_minisci     # optional preset every trial starts from
    overrides: [trainer.iterations=20]   # fixed for every trial (the command line adds more)
    metric: val/score_nomem         # objective: its final value; reported at every validation for pruning
    direction: maximize
    n_trials: 20                    # the study's total: finished trials (any state) count toward it
    timeout: null                   # seconds after which no new trial starts
    seed: 0                         # TPE seed
    storage: null                   # null: sqlite under the run root; postgresql://... or mysql://... to share
    heartbeat: {interval: 60, grace_period: 180, max_retry: 1}   # a trial silent for grace_period s is re-queued
    sampler: {n_startup_trials: 5}  # TPESampler arguments
    pruner: {type: median, n_startup_trials: 3, n_warmup_steps: 1}   # or {type: none}
    space:
      algo.p: {type: float, low: 0.1, high: 0.6}
      algo.delta: {type: float, low: 1.0e-4, high: 0.1, log: true}
      algo.mode_granularity: [step, episode, batch]     # a list is categorical
    enqueue: [{algo.p: 0.25}]       # trials evaluated first, only when the study is new

The driver asks the study for a trial and starts `python -m empo2.sweep_trial <study> <n> <overrides>`
(so DDP/FSDP trials launch their ranks as `empo2 train` does, each worker on its own GPUs); the
trial process reports the metric to the shared RDB storage after each validation, stops when the
median pruner says so, and tells the study its result. An MLflow parent run stands for the study;
every trial's run is nested under it.

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

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from empo2.config import ConfigError, TrainConfig, load_config
from empo2.experiments import check_keys, read_yaml, string_list
from empo2.launch import WorkerPool, hydra_quote, last_line
from empo2.sweep_storage import open_storage, shown_url, storage_lock

SWEEP_KEYS = ("study", "mlflow_experiment", "preset", "overrides", "metric", "direction", "n_trials", "timeout",
              "seed", "storage", "heartbeat", "sampler", "pruner", "space", "enqueue")
HEARTBEAT = {"interval": 60, "grace_period": 180, "max_retry": 1}
PARAM_KEYS = {"float": ("type", "low", "high", "log", "step"), "int": ("type", "low", "high", "log", "step"),
              "categorical": ("type", "choices")}
STORAGE_ENV = "EMPO2_SWEEP_STORAGE"  # the storage URL reaches trial processes here, never on a command line


@dataclass
class Param:
    """One search-space entry: a config key and its Optuna distribution."""

    key: str
    kind: str
    low: Any = None
    high: Any = None
    log: bool = False
    step: Any = None
    choices: list = field(default_factory=list)

    def suggest(self, trial) -> Any:
        if self.kind == "float":
            return trial.suggest_float(self.key, self.low, self.high, log=self.log, step=self.step)
        if self.kind == "int":
            return trial.suggest_int(self.key, self.low, self.high, log=self.log, step=self.step or 1)
        return trial.suggest_categorical(self.key, self.choices)

    def override(self, value: Any) -> str:
        if isinstance(value, bool) or value is None:
            text = {True: "true", False: "false", None: "null"}[value]
        elif isinstance(value, (int, float)):
            text = repr(value)
        else:
            text = hydra_quote(value)
        return f"{self.key}={text}"

    def endpoints(self) -> list:
        return list(self.choices) if self.kind == "categorical" else [self.low, self.high]

    def record(self) -> dict:
        """The distribution as plain data, kept in the study to recognise a changed search space."""
        if self.kind == "categorical":
            return {"type": "categorical", "choices": list(self.choices)}
        return {"type": self.kind, "low": self.low, "high": self.high, "log": self.log, "step": self.step}


@dataclass
class SweepSpec:
    path: Path
    study: str
    mlflow_experiment: str
    preset: str | None
    fixed: list[str]  # the file's fixed overrides, then the command line's
    metric: str
    direction: str
    n_trials: int
    timeout: float | None
    seed: int
    storage: str | None
    heartbeat: dict
    sampler: dict
    pruner: dict
    space: list[Param]
    enqueue: list[dict]
    cfg: TrainConfig  # the fixed part, composed: run root, tracking URI

    @property
    def base(self) -> list[str]:
        """What every trial's overrides start with."""
        return ([f"experiment={self.preset}"] if self.preset else []) + self.fixed


def _param(key: str, spec: Any, path: Path) -> Param:
    where = f"{path}: space.{key}"
    if isinstance(spec, list):
        spec = {"type": "categorical", "choices": spec}
    if not isinstance(spec, dict) or spec.get("type") not in PARAM_KEYS:
        raise ConfigError(f"{where}: expected a list of choices or a mapping with type float, int or categorical")
    check_keys(spec, PARAM_KEYS[spec["type"]], where)
    p = Param(key, spec["type"], spec.get("low"), spec.get("high"), bool(spec.get("log", False)), spec.get("step"),
              list(spec.get("choices") or []))
    if p.kind == "categorical":
        if not p.choices:
            raise ConfigError(f"{where}: choices is empty")
        return p
    num = float if p.kind == "float" else int
    for name in ("low", "high"):
        value = getattr(p, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (num is int and value != int(value)):
            raise ConfigError(f"{where}: {name} must be a{'n int' if num is int else ' number'}, got {value!r}")
        setattr(p, name, num(value))
    if not p.low < p.high:
        raise ConfigError(f"{where}: low={p.low} must be below high={p.high}")
    if p.log and p.low <= 0:
        raise ConfigError(f"{where}: log=true needs low > 0, got {p.low}")
    if p.log and p.step is not None:
        raise ConfigError(f"{where}: step cannot be used with log=true")
    return p


def load_sweep(path: str | Path, overrides: list[str] | tuple = ()) -> SweepSpec:
    """Read and check a sweep file; every search-space end point is composed into a config, so a bad
    key or range fails here with the file and key named, before any trial starts."""
    path = Path(path)
    data = read_yaml(path, "sweep file")
    check_keys(data, SWEEP_KEYS, path)
    study = data.get("study")
    if not isinstance(study, str) or not study.strip():
        raise ConfigError(f"{path}: study (the Optuna study name) is required")
    direction = data.get("direction", "maximize")
    if direction not in ("maximize", "minimize"):
        raise ConfigError(f"{path}: direction={direction!r} is not allowed: expected maximize or minimize")
    n_trials, seed, timeout = data.get("n_trials", 20), data.get("seed", 0), data.get("timeout")
    if not isinstance(n_trials, int) or isinstance(n_trials, bool) or n_trials < 1:
        raise ConfigError(f"{path}: n_trials={n_trials!r} is out of range: expected an int >= 1")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ConfigError(f"{path}: seed={seed!r} is out of range: expected an int >= 0")
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ConfigError(f"{path}: timeout={timeout!r} is out of range: expected seconds > 0 or null")
    space_raw = data.get("space")
    if not isinstance(space_raw, dict) or not space_raw:
        raise ConfigError(f"{path}: space is empty or missing")
    space = [_param(str(k), v, path) for k, v in space_raw.items()]
    preset = data.get("preset")
    if preset is not None and not isinstance(preset, str):
        raise ConfigError(f"{path}: preset must be a preset name, got {preset!r}")
    fixed = string_list(data.get("overrides"), "overrides", path) + list(overrides)
    base = ([f"experiment={preset}"] if preset else []) + fixed
    try:
        cfg = load_config(base)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    if cfg.logger.name != "mlflow":
        raise ConfigError(f"{path}: sweep trials are tracked in MLflow; drop logger={cfg.logger.name}")
    for p in space:
        for value in p.endpoints():
            try:
                load_config(base + [p.override(value)])
            except ConfigError as e:
                raise ConfigError(f"{path}: space.{p.key}: {e}") from None
    enqueue = data.get("enqueue") or []
    if not isinstance(enqueue, list) or not all(isinstance(e, dict) for e in enqueue):
        raise ConfigError(f"{path}: enqueue must be a list of mappings from space keys to values")
    for e in enqueue:
        unknown = sorted(set(e) - {p.key for p in space})
        if unknown:
            raise ConfigError(f"{path}: enqueue: {unknown[0]!r} is not a key of space")
    heartbeat = _heartbeat(data.get("heartbeat"), path)
    sampler, pruner = data.get("sampler") or {}, data.get("pruner") or {"type": "median"}
    if not isinstance(sampler, dict) or not isinstance(pruner, dict):
        raise ConfigError(f"{path}: sampler and pruner must be mappings of arguments")
    metric = data.get("metric", "val/score_nomem")
    if not isinstance(metric, str) or not metric:
        raise ConfigError(f"{path}: metric must be the name of a logged metric, e.g. val/score_nomem")
    for what, build in (("sampler", lambda: make_sampler(sampler, seed)), ("pruner", lambda: make_pruner(pruner))):
        try:
            build()
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{path}: {what}: {e}") from None
    return SweepSpec(path, study, str(data.get("mlflow_experiment") or study), preset, fixed, metric, direction,
                     n_trials, timeout, seed, data.get("storage"), heartbeat, sampler, pruner, space, enqueue, cfg)


def _heartbeat(raw: Any, path: Path) -> dict:
    if raw is None:
        return dict(HEARTBEAT)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: heartbeat must be a mapping with interval, grace_period and max_retry")
    check_keys(raw, tuple(HEARTBEAT), f"{path}: heartbeat")
    hb = {**HEARTBEAT, **raw}
    for key, low in (("interval", 1), ("grace_period", 1), ("max_retry", 0)):
        if not isinstance(hb[key], int) or isinstance(hb[key], bool) or hb[key] < low:
            raise ConfigError(f"{path}: heartbeat.{key}={hb[key]!r} is out of range: expected an int >= {low}")
    if hb["grace_period"] <= hb["interval"]:
        raise ConfigError(f"{path}: heartbeat.grace_period={hb['grace_period']} must exceed "
                          f"heartbeat.interval={hb['interval']}: a live trial would be taken for a lost one")
    return hb


def make_sampler(spec: dict, seed: int):
    import optuna

    return optuna.samplers.TPESampler(seed=seed, **spec)


def make_pruner(spec: dict):
    import optuna

    kwargs = {k: v for k, v in spec.items() if k != "type"}
    kind = spec.get("type", "median")
    if kind == "none":
        if kwargs:
            raise ValueError(f"type none takes no arguments, got {sorted(kwargs)}")
        return optuna.pruners.NopPruner()
    if kind != "median":
        raise ValueError(f"type={kind!r} is not allowed: expected median or none")
    return optuna.pruners.MedianPruner(**kwargs)


def _parent_run(study, spec: SweepSpec, storage_url: str) -> str:
    """The study's MLflow parent run: created once and remembered in the study itself, so a continued
    study, or a driver on another host, nests its trials under the same run."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from empo2.train import tracking_uri

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
    experiment = client.get_experiment_by_name(spec.mlflow_experiment)
    exp_id = experiment.experiment_id if experiment else client.create_experiment(spec.mlflow_experiment)
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
    """The best trial as a preset file: the sweep's preset and fixed overrides, then its parameters."""
    import yaml

    best = study.best_trial
    params = {p.key: best.params[p.key] for p in spec.space if p.key in best.params}
    lines = [p.override(params[p.key]) for p in spec.space if p.key in params]
    header = (f"# Best trial {best.number} of Optuna study {spec.study!r}: {spec.metric} = {best.value:.6g} "
              f"({spec.direction}).\n# Train with it: empo2 train experiment={path}\n")
    preset = {"base": spec.preset} if spec.preset else {}
    body = yaml.safe_dump({**preset, "overrides": spec.fixed + lines}, sort_keys=False, width=1000)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(header + body)
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
              timeout: float | None = None, storage: str | None = None) -> dict:
    """Run (or continue) a study until it holds `n_trials` finished trials or `timeout` seconds have
    passed. Returns the study name, storage, counts per state, the best trial and the best-file path.
    Any number of these drivers, on any hosts, may run at once on one shared storage."""
    import optuna

    spec = load_sweep(path, overrides)
    n_trials = spec.n_trials if n_trials is None else n_trials
    timeout = spec.timeout if timeout is None else timeout
    if n_trials < 1:
        raise ConfigError(f"--n-trials={n_trials} is out of range: expected >= 1")
    root = Path(spec.cfg.run_root).expanduser().resolve()
    url = storage or spec.storage or f"sqlite:///{root / 'optuna.db'}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the driver prints its own lines
    study, rdb, parent = _open_study(spec, url)
    State = optuna.trial.TrialState
    done_states = (State.COMPLETE, State.PRUNED, State.FAIL)
    trials = study.get_trials(deepcopy=False)
    n_done = sum(1 for t in trials if t.state in done_states and t.number not in _replaced(trials))
    print(f"study {spec.study}: {n_done} of {n_trials} trials finished; storage "
          f"{url if url.startswith('sqlite') else shown_url(url)}")
    _run_trials(study, rdb, spec, root, workers, n_trials, timeout)

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
                take_over_stale()
                with storage_lock(url):  # counting and asking at once: drivers never overshoot n_trials
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
                        pool.start(trial.number, "empo2.sweep_trial", args, log, env={STORAGE_ENV: url})
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


def _close_parent(spec: SweepSpec, run_id: str, result: dict) -> None:
    """Best value and parameters onto the parent run (as tags: a continued study may change them,
    and MLflow params cannot change), then mark it finished."""
    from mlflow.tracking import MlflowClient

    from empo2.train import tracking_uri

    client = MlflowClient(tracking_uri(spec.cfg))
    for state, n in result["counts"].items():
        client.set_tag(run_id, f"optuna.n_{state}", str(n))
    if result["best"]:
        client.set_tag(run_id, "optuna.best_trial", str(result["best"]["number"]))
        client.log_metric(run_id, "best_value", result["best"]["value"], step=sum(result["counts"].values()))
        for key, value in result["best"]["params"].items():
            client.set_tag(run_id, f"best.{key}", str(value))
    client.set_terminated(run_id)

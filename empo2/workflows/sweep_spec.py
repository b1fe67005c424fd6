"""Sweep files: the study settings and search space of an `empo2 sweep`, read and checked.

A sweep file (sweeps/*.yaml) holds the study settings and the search space:

    study: empo2-minisci            # Optuna study name; running the same name again continues it
    preset: empo2_paper_minisci     # optional preset every trial starts from
    overrides: [trainer.iterations=20]   # fixed for every trial (the command line adds more)
    metric: val/score_nomem         # objective: its final value; reported at every validation for pruning
    direction: maximize
    n_trials: 20                    # the study's total over all workers: running and finished trials count
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

Every search-space end point is composed into a config when the file is read, so a bad key or range
fails with the file and key named before any trial starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from empo2.config import ConfigError, TrainConfig, current_metric, load_config
from empo2.config.experiments import check_keys, read_yaml, string_list
from empo2.workflows.launch import hydra_quote, load_run_config

SWEEP_KEYS = ("study", "mlflow_experiment", "preset", "overrides", "metric", "direction", "n_trials", "timeout",
              "seed", "storage", "heartbeat", "sampler", "pruner", "space", "enqueue")
HEARTBEAT = {"interval": 60, "grace_period": 180, "max_retry": 1}
PARAM_KEYS = {"float": ("type", "low", "high", "log", "step"), "int": ("type", "low", "high", "log", "step"),
              "categorical": ("type", "choices")}


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
    cfg = load_run_config(base, str(path), "sweep trials")
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
    metric = current_metric(metric)  # a file written before a metric's rename optimises it under today's name
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

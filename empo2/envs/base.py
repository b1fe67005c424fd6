"""The environment surface every text environment implements, and the registry behind `make_env`.

An environment is a multi-step text task: `reset` gives the first observation, `step` takes the
model's raw text (never trusted: it goes through `empo2.envs.actions.parse_action` first) and returns
a `StepResult`. `info["score"]` is the task score in [0, 100] and `info["won"]` a bool, so the
collector computes returns the same way for every environment.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass
class StepResult:
    obs: str
    reward: float  # change of the task score, scaled (default: score delta / 100)
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TaskSpec:
    """One task instance: a task (family) name and a variation index within it."""

    task: str
    variation: int


@runtime_checkable
class TextEnv(Protocol):
    task_description: str

    def reset(self, task: str | None = None, variation: int | None = None) -> tuple[str, dict[str, Any]]: ...

    def step(self, action_text: str) -> StepResult: ...

    def valid_actions(self) -> list[str]: ...

    def state_key(self) -> str: ...

    def close(self) -> None: ...


def stable_hash(*parts: str) -> str:
    """A process-independent hash (Python's `hash` is salted per process, novelty counts must not be)."""
    h = hashlib.blake2b(digest_size=12)
    for part in parts:
        h.update(part.encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    return h.hexdigest()


SPLITS = ("train", "dev", "test")


@dataclass
class Catalogue:
    """Task instances of one environment: per task, deterministic train/dev/test variation lists, plus
    the tasks held out as out-of-distribution (never sampled for training).

    `variations[task][split]` is a sorted list of variation indices; the splits of a task are disjoint
    and do not depend on the process, the machine or the order of calls.
    """

    variations: dict[str, dict[str, list[int]]]
    ood_tasks: list[str] = field(default_factory=list)

    def tasks(self, include_ood: bool = False) -> list[str]:
        return [t for t in self.variations if include_ood or t not in self.ood_tasks]

    def split(self, task: str, split: str) -> list[int]:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
        if task not in self.variations:
            raise ValueError(f"unknown task {task!r}; known: {sorted(self.variations)}")
        return self.variations[task][split]

    def sample(self, n: int, split: str, seed: int, tasks: list[str] | None = None,
               variations: int | None = None) -> list[TaskSpec]:
        """`n` task instances drawn uniformly over (task, variation) pairs of `split` (only the first
        `variations` of each task's split when given), reproducible from `seed` alone (a local generator:
        no global RNG state is read or changed).

        Drawn without replacement: two groups of one instance in a batch would be normalised apart, each
        against half the rollouts it could be compared with. Only when `n` exceeds the pool does an
        instance recur, once per further shuffled pass over the pool."""
        import random

        pool = [TaskSpec(t, v) for t in (tasks or self.tasks()) for v in self.split(t, split)[:variations]]
        if not pool:
            raise ValueError(f"no task instances in split {split!r} for tasks {tasks or self.tasks()}")
        rng = random.Random(seed)
        out: list[TaskSpec] = []
        while len(out) < n:
            out += rng.sample(pool, min(len(pool), n - len(out)))
        return out


def hash_splits(salt: str, task: str, sizes: dict[str, int]) -> dict[str, list[int]]:
    """Disjoint train/dev/test variation lists for one task: variations 0..sum(sizes)-1 ordered by a stable
    hash of (salt, task, variation) and cut in that order, so every process and machine gets the same."""
    order = sorted(range(sum(sizes.values())), key=lambda v: stable_hash(salt, task, str(v)))
    splits, start = {}, 0
    for split in SPLITS:
        splits[split] = sorted(order[start : start + sizes[split]])
        start += sizes[split]
    return splits


_REGISTRY: dict[str, Callable[..., TextEnv]] = {}


def register_env(name: str) -> Callable[[Callable[..., TextEnv]], Callable[..., TextEnv]]:
    def deco(factory: Callable[..., TextEnv]) -> Callable[..., TextEnv]:
        _REGISTRY[name] = factory
        return factory

    return deco


def make_env(name: str, **kwargs: Any) -> TextEnv:
    """Build a registered environment by name (`minisci`, `scienceworld`, ...)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown environment {name!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name](**kwargs)


def get_catalogue(name: str) -> Catalogue:
    """The task catalogue of an environment: each environment module exposes `catalogue()`."""
    import importlib

    if name not in _REGISTRY:
        raise ValueError(f"unknown environment {name!r}; registered: {sorted(_REGISTRY)}")
    return importlib.import_module(f"empo2.envs.{name}").catalogue()


def registered_envs() -> list[str]:
    return sorted(_REGISTRY)

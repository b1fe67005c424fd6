"""Tip records: what is stored next to each embedding, and how caller metadata becomes a record."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

NAMESPACE_MODES = ("variation", "task", "global")
GLOBAL_NAMESPACE = "*"

# Metadata a caller may attach to a tip, with defaults; anything else is rejected so a typo
# ("varation") fails loudly instead of silently landing every tip in one namespace.
META_DEFAULTS: dict[str, object] = {
    "task": None,
    "variation": None,
    "episode_return": 0.0,
    "iteration": 0,
    "source_rank": 0,
    "step": None,
    "action": None,
}


@dataclass(frozen=True)
class TipRecord:
    """One stored memory entry. Frozen: search results are snapshots, updates replace the record.

    `id` is unique within a memory and increases with insertion order. `utility_sum` and
    `utility_count` accumulate the returns of episodes whose prompts carried this tip.
    """

    id: int
    text: str
    namespace: str
    task: str | None
    variation: int | str | None
    episode_return: float
    iteration: int
    source_rank: int
    step: int | None = None
    action: str | None = None
    utility_sum: float = 0.0
    utility_count: int = 0

    @property
    def utility(self) -> float:
        """Running mean return of the episodes that used the tip.

        A tip no episode has used yet is scored by its own episode's return, the only evidence
        about it, so new tips are neither favoured nor punished against used ones.
        """
        if self.utility_count == 0:
            return self.episode_return
        return self.utility_sum / self.utility_count

    def meta(self) -> dict[str, object]:
        """The metadata this record was added with (the `metas` entry of `TipMemory.add`)."""
        return {key: getattr(self, key) for key in META_DEFAULTS}

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: object, where: str) -> TipRecord:
        """Builds a record from its JSON form; `where` names the source in errors."""
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected an object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        missing = names - data.keys()
        unknown = data.keys() - names
        if missing or unknown:
            raise ValueError(f"{where}: missing fields {sorted(missing)}, unknown fields {sorted(unknown)}")
        checks = {
            "id": (int,), "text": (str,), "namespace": (str,), "episode_return": (int, float),
            "iteration": (int,), "source_rank": (int,), "utility_sum": (int, float),
            "utility_count": (int,),
        }
        for key, types in checks.items():
            if not isinstance(data[key], types) or isinstance(data[key], bool):
                raise ValueError(f"{where}: field {key!r} has type {type(data[key]).__name__}")
        return cls(**{**data, "episode_return": float(data["episode_return"]),
                      "utility_sum": float(data["utility_sum"])})


def parse_meta(meta: Mapping[str, object], position: int) -> dict[str, object]:
    """Validates one caller meta dict and fills defaults; `position` names it in errors."""
    if not isinstance(meta, Mapping):
        raise TypeError(f"metas[{position}] must be a mapping, got {type(meta).__name__}")
    unknown = set(meta) - META_DEFAULTS.keys()
    if unknown:
        raise ValueError(f"metas[{position}] has unknown keys {sorted(unknown)}; allowed: {list(META_DEFAULTS)}")
    out = {**META_DEFAULTS, **meta}
    if out["task"] is not None and not isinstance(out["task"], str):
        raise TypeError(f"metas[{position}]['task'] must be str, got {type(out['task']).__name__}")
    if not isinstance(out["episode_return"], (int, float)):
        raise TypeError(f"metas[{position}]['episode_return'] must be a number")
    out["episode_return"] = float(out["episode_return"])
    for key in ("iteration", "source_rank"):
        out[key] = int(out[key])  # type: ignore[call-overload]
    if out["step"] is not None:
        out["step"] = int(out["step"])  # type: ignore[call-overload]
    return out


def namespace_key(mode: str, task: str | None, variation: int | str | None) -> str:
    """The namespace a tip lives in: one per task variation, one per task, or one for everything."""
    if mode == "global":
        return GLOBAL_NAMESPACE
    if not task:
        raise ValueError(f"namespace mode {mode!r} needs a task name")
    if mode == "task":
        return task
    if mode == "variation":
        if variation is None:
            raise ValueError(f"namespace mode 'variation' needs a variation for task {task!r}")
        return f"{task}/{variation}"
    raise ValueError(f"unknown namespace mode {mode!r}; expected one of {NAMESPACE_MODES}")

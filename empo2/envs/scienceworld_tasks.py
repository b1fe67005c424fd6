"""ScienceWorld's task list, step budgets, simplifications and variation splits (the catalogue).

The train / dev / test variation lists are the package's own (`getVariationsTrain/Dev/Test`, a
50/25/25 split by variation index). The package exposes them only through a running simulator, so
`catalogue()` asks a JVM once (seconds: docs/performance.md) and caches the answer as JSON under `$EMPO2_CACHE` (default
`~/.cache/empo2`), keyed by the package version (and the jar, when a custom one is given); later
calls, in any process, read the file and start no JVM.
"""

from __future__ import annotations

import json
import os
import tempfile
from importlib import metadata
from pathlib import Path

from empo2.envs.base import SPLITS, Catalogue

# Step budget per task (agent steps, invalid ones included): what `ScienceWorldTextEnv` uses when
# `max_steps` is not given. The base is the per-task table most ScienceWorld LLM-agent work uses
# (ETO/AgentBoard `max_steps.json`), with power-component = 30 as in the released EMPO² code, capped
# at the released env step limit (`ENV_STEP_LIMIT`). The released code's multi-task data uses 30 for
# every task: pass max_steps=30 for that.
#
# No budget is shorter than the package's own gold path. benchmarks/scienceworld_gold_paths.py plays
# the gold path through the adapter under "easy" on every train variation and the first 20 test
# variations (what the project trains and validates on) and records the longest, in adapter steps
# (reports/scienceworld_gold_paths/scienceworld_gold_paths.json; tests/integration/test_scienceworld.py checks
# the table against it). Where the base is shorter, the budget is that longest gold path + 10%,
# rounded up to a multiple of 5 (in brackets below: base, longest gold path). The 10% is there
# because the gold path is not fixed: the simulator draws it again at every load and its length
# varies between loads (boil test variation 22: 190 steps in one load, 172-173 in four others), so a
# budget equal to one measurement can still cut a gold path off. Gold paths are not shortest paths:
# the inclined-plane ones "look" repeatedly while a block slides (up to 796 steps), where an agent
# can "wait"; the budget covers them anyway.
TASK_BUDGETS: dict[str, int] = {
    "boil": 210,  # (100, 190)
    "change-the-state-of-matter-of": 155,  # (80, 139)
    "chemistry-mix": 60,
    "chemistry-mix-paint-secondary-color": 35,  # (15, 30)
    "chemistry-mix-paint-tertiary-color": 45,  # (30, 38)
    "find-animal": 20,  # (15, 16)
    "find-living-thing": 20,  # (15, 16)
    "find-non-living-thing": 15,
    "find-plant": 20,  # (15, 16)
    "freeze": 165,  # (80, 148)
    "grow-fruit": 90,  # (60, 80)
    "grow-plant": 50,  # (30, 42)
    "identify-life-stages-1": 45,  # (30, 40)
    "identify-life-stages-2": 30,
    "inclined-plane-determine-angle": 215,  # (40, 192)
    "inclined-plane-friction-named-surfaces": 880,  # (40, 796)
    "inclined-plane-friction-unnamed-surfaces": 255,  # (40, 230)
    "lifespan-longest-lived": 10,
    "lifespan-longest-lived-then-shortest-lived": 12,
    "lifespan-shortest-lived": 10,
    "measure-melting-point-known-substance": 100,  # ETO's 120 capped at ENV_STEP_LIMIT
    "measure-melting-point-unknown-substance": 100,  # ETO's 120 capped at ENV_STEP_LIMIT
    "melt": 175,  # (80, 159)
    "mendelian-genetics-known-plant": 150,  # (50, 135)
    "mendelian-genetics-unknown-plant": 150,  # (50, 135)
    "power-component": 30,
    "power-component-renewable-vs-nonrenewable-energy": 30,
    "test-conductivity": 50,  # (30, 44)
    "test-conductivity-of-unknown-substances": 50,  # (30, 42)
    "use-thermometer": 30,
}
TASKS: tuple[str, ...] = tuple(TASK_BUDGETS)

# The released code's environment step limit (the package's `envStepLimit`). It caps the base table
# above; a budget raised to cover a gold path may exceed it (the adapter steps the simulator
# directly, so the package's own limit does not apply).
ENV_STEP_LIMIT = 100

# Held out of training by default: the "unknown" twin of a trained task, so memory-only adaptation
# has related experience to draw on. This project's choice, not the paper's (which does not list
# its held-out tasks); `catalogue(ood_tasks=...)` takes any other list.
DEFAULT_OOD_TASKS: tuple[str, ...] = (
    "measure-melting-point-unknown-substance",
    "test-conductivity-of-unknown-substances",
    "inclined-plane-friction-unnamed-surfaces",
    "mendelian-genetics-unknown-plant",
)

# "easy" = teleportAction, openDoors, selfWateringFlowerPots and, except for the electrical tasks,
# noElectricalAction (resolved inside the simulator).
SIMPLIFICATIONS: tuple[str, ...] = (
    "teleportAction", "selfWateringFlowerPots", "openContainers", "openDoors", "noElectricalAction",
)
ELECTRICAL_TASKS = ("power-component", "conductivity")


def check_task(task: str) -> str:
    if task not in TASK_BUDGETS:
        raise ValueError(f"unknown ScienceWorld task {task!r}; known tasks: {sorted(TASK_BUDGETS)}")
    return task


def check_simplification(simplification: str) -> str:
    """`"easy"`, `""` (none) or a comma-separated subset of `SIMPLIFICATIONS`."""
    if not isinstance(simplification, str):
        raise ValueError(f"simplification must be a string, got {simplification!r}")
    if simplification in ("easy", ""):
        return simplification
    parts = [p.strip() for p in simplification.split(",")]
    bad = [p for p in parts if p not in SIMPLIFICATIONS]
    if bad:
        raise ValueError(f"unknown simplification {bad}; use 'easy', '' or a comma-separated subset of "
                         f"{list(SIMPLIFICATIONS)}")
    return ",".join(parts)


def cache_dir() -> Path:
    return Path(os.environ.get("EMPO2_CACHE") or Path.home() / ".cache" / "empo2")


def catalogue(ood_tasks: tuple[str, ...] | list[str] = DEFAULT_OOD_TASKS, *, refresh: bool = False,
              jar_path: str | None = None, call_timeout_s: float = 10.0) -> Catalogue:
    """All 30 tasks with the package's train/dev/test variation splits; `ood_tasks` are held out.

    Reads the cache file when present (no JVM); otherwise, or with `refresh=True`, enumerates the
    splits on a temporary JVM and writes the cache atomically (a reader never sees half a file).
    """
    for task in ood_tasks:
        check_task(task)
    path = catalogue_cache_path(jar_path)
    variations = None if refresh else _read_cache(path)
    if variations is None:
        variations = _enumerate_splits(jar_path, call_timeout_s)
        _write_atomic(path, {"scienceworld": _package_version(), "variations": variations})
    return Catalogue(variations=variations, ood_tasks=list(ood_tasks))


def catalogue_cache_path(jar_path: str | None = None) -> Path:
    name = f"scienceworld-{_package_version()}"
    if jar_path is not None:
        from empo2.envs.base import stable_hash

        st = os.stat(jar_path)
        name += "-" + stable_hash(os.path.abspath(jar_path), str(st.st_size), str(st.st_mtime_ns))
    return cache_dir() / f"{name}-variations.json"


def _package_version() -> str:
    try:
        return metadata.version("scienceworld")
    except metadata.PackageNotFoundError:
        return "unknown"


def _read_cache(path: Path) -> dict[str, dict[str, list[int]]] | None:
    """The cached splits, or None when the file is missing or not a complete catalogue."""
    try:
        variations = json.loads(path.read_text())["variations"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    ok = (isinstance(variations, dict) and set(variations) == set(TASKS)
          and all(isinstance(v, dict) and set(v) == set(SPLITS)
                  and all(isinstance(x, int) for s in SPLITS for x in v[s]) for v in variations.values()))
    return {t: variations[t] for t in TASKS} if ok else None


def _enumerate_splits(jar_path: str | None, call_timeout_s: float) -> dict[str, dict[str, list[int]]]:
    from empo2.envs.jvm import Jvm

    jvm = Jvm(jar_path, call_timeout_s)
    try:
        names = sorted(str(n) for n in jvm.call("getTaskNames"))
        if names != sorted(TASKS):
            raise RuntimeError(f"the scienceworld package's tasks {names} differ from this adapter's {TASKS}")
        out = {}
        for task in TASKS:
            # The splits depend only on the task's variation count, which the simulator reads from
            # the loaded task; no simplification is needed for that.
            err = jvm.call("load", task, 0, "", False, timeout=6 * call_timeout_s)
            if err:
                raise RuntimeError(f"loading {task!r}: {err}")
            out[task] = {
                "train": sorted(int(v) for v in jvm.call("getVariationsTrain")),
                "dev": sorted(int(v) for v in jvm.call("getVariationsDev")),
                "test": sorted(int(v) for v in jvm.call("getVariationsTest")),
            }
        return out
    finally:
        jvm.close()


def _write_atomic(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise

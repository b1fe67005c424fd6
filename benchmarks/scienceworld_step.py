"""Median step time of the ScienceWorld adapter against the package's plain `ScienceWorldEnv.step`.

Replays the package's gold paths (so every step does real work) on a few tasks, timing:

- `package_step`: `scienceworld.ScienceWorldEnv.step` (recomputes the valid-action list every step);
- `adapter_step`: `make_env("scienceworld").step` with action correction on, exact actions;
- `adapter_step+state_key`: the same plus `state_key()`, as a training step with novelty does;
- `adapter_corrected`: the gold action's words reversed, so the simulator rejects it and the
  adapter falls back to the valid list and Jaccard correction (the slow path).

Usage: `python benchmarks/scienceworld_step.py [--out results.json] [--repeats 3] [--tasks a b ...]`.
Prints a table and writes JSON (default: benchmarks/results/scienceworld_step.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from empo2.envs import make_env

DEFAULT_TASKS = ["find-living-thing", "use-thermometer", "power-component", "boil", "chemistry-mix"]
SIMPLIFICATION = "easy"


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _time_package(pkg_env, task: str, variation: int, gold: list[str]) -> list[float]:
    pkg_env.load(task, variation, SIMPLIFICATION)
    pkg_env.reset()
    out = []
    for action in gold:
        t0 = time.perf_counter()
        _, _, done, _ = pkg_env.step(action)
        out.append(time.perf_counter() - t0)
        if done:
            break
    return out


def _time_adapter(env, task: str, variation: int, gold: list[str], mode: str) -> list[float]:
    env.reset(task, variation)
    out = []
    for action in gold:
        if action == "0":  # answers an ambiguity prompt; the adapter answers those itself
            continue
        text = " ".join(reversed(action.split())) if mode == "adapter_corrected" else action
        t0 = time.perf_counter()
        res = env.step(text)
        if mode == "adapter_step+state_key":
            env.state_key()
        out.append(time.perf_counter() - t0)
        if res.done:
            break
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "scienceworld_step.json")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tasks", nargs="+", default=DEFAULT_TASKS)
    parser.add_argument("--variation", type=int, default=0)
    args = parser.parse_args()

    from scienceworld import ScienceWorldEnv

    modes = ["package_step", "adapter_step", "adapter_step+state_key", "adapter_corrected"]
    env = make_env("scienceworld", simplification=SIMPLIFICATION, max_steps=1000)
    pkg_env = ScienceWorldEnv("", envStepLimit=1000)
    times: dict[str, dict[str, list[float]]] = {m: {} for m in modes}
    try:
        golds = {t: env.gold_actions(t, args.variation) for t in args.tasks}
        for _ in range(args.repeats):  # interleaved so drift in machine load hits every mode alike
            for task, gold in golds.items():
                times["package_step"].setdefault(task, []).extend(
                    _time_package(pkg_env, task, args.variation, gold))
                for mode in modes[1:]:
                    times[mode].setdefault(task, []).extend(
                        _time_adapter(env, task, args.variation, gold, mode))
    finally:
        env.close()
        pkg_env.close()

    results = {}
    for mode in modes:
        every = [x for xs in times[mode].values() for x in xs]
        results[mode] = {
            "median_ms": 1000 * statistics.median(every),
            "p90_ms": 1000 * _percentile(every, 0.9),
            "steps": len(every),
            "per_task_median_ms": {t: 1000 * statistics.median(xs) for t, xs in times[mode].items()},
        }
    speedup = results["package_step"]["median_ms"] / results["adapter_step"]["median_ms"]

    print(f"{'mode':<24}{'median ms':>10}{'p90 ms':>10}{'steps':>8}")
    for mode, r in results.items():
        print(f"{mode:<24}{r['median_ms']:>10.2f}{r['p90_ms']:>10.2f}{r['steps']:>8}")
    print(f"adapter speed-up over the package step (median): {speedup:.1f}x")

    payload = {
        "benchmark": "scienceworld_step",
        "tasks": args.tasks, "variation": args.variation, "repeats": args.repeats,
        "simplification": SIMPLIFICATION, "results": results, "speedup_median": speedup,
        "machine": {"python": platform.python_version(), "platform": platform.platform(),
                    "processor": platform.processor()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

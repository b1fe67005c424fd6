"""MiniSci throughput and the random-policy baseline.

Runs every test variation of every family along the gold path, and with a uniformly random policy
over `valid_actions()` (seeded), with and without its `focus on` actions. Reports steps per second
for `step()` alone and for the random loop including the valid-action listing, plus the random
policy's mean score per family (the exploration trap: it should stay far below the gold path's 100).

    python benchmarks/minisci_speed.py [out.json] [--rounds N] [--hard]

Writes JSON to the given path, or to benchmarks/results/minisci_speed.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

from empo2.envs import make_env
from empo2.envs.minisci import FAMILIES, catalogue

HARD = {"num_rooms": 9, "num_distractors": 4, "num_decoys": 4, "closed_doors": True, "hide_prob": 1.0}


def gold_rollouts(env, rounds: int) -> dict:
    steps, step_time, resets, reset_time = 0, 0.0, 0, 0.0
    for _ in range(rounds):
        for family in FAMILIES:
            for variation in catalogue().split(family, "test"):
                start = time.perf_counter()
                env.reset(task=family, variation=variation)
                reset_time += time.perf_counter() - start
                resets += 1
                actions = env.gold_actions()
                start = time.perf_counter()
                for action in actions:
                    env.step(action)
                step_time += time.perf_counter() - start
                steps += len(actions)
    return {
        "steps": steps,
        "steps_per_s": steps / step_time,
        "resets_per_s": resets / reset_time,
        "episodes_per_s": resets / (step_time + reset_time),
    }


def random_rollouts(env, rounds: int, seed: int, allow_focus: bool = True) -> dict:
    """Uniformly random valid actions; without `allow_focus` the `focus on` actions are left out,
    which shows how far undirected exploration gets when the trap cannot spring."""
    rng = random.Random(seed)
    steps, loop_time, step_time = 0, 0.0, 0.0
    scores: dict[str, list[int]] = {family: [] for family in FAMILIES}
    failed: dict[str, int] = dict.fromkeys(FAMILIES, 0)
    for _ in range(rounds):
        for family in FAMILIES:
            for variation in catalogue().split(family, "test"):
                env.reset(task=family, variation=variation)
                done = False
                while not done:
                    start = time.perf_counter()
                    valid = env.valid_actions()
                    if not allow_focus:
                        valid = [a for a in valid if not a.startswith("focus on ")]
                    action = rng.choice(valid)
                    middle = time.perf_counter()
                    result = env.step(action)
                    end = time.perf_counter()
                    loop_time += end - start
                    step_time += end - middle
                    steps += 1
                    done = result.done
                scores[family].append(result.info["score"])
                failed[family] += result.info["failed"]
    return {
        "steps": steps,
        "steps_per_s": steps / step_time,
        "steps_per_s_with_valid_actions": steps / loop_time,
        "mean_score": {f: sum(s) / len(s) for f, s in scores.items()},
        "failed_by_wrong_focus": {f: failed[f] / len(scores[f]) for f in FAMILIES},
        "mean_episode_steps": steps / sum(len(s) for s in scores.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=str(Path(__file__).parent / "results" / "minisci_speed.json"))
    parser.add_argument("--rounds", type=int, default=3, help="passes over all test variations")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random policy")
    parser.add_argument("--hard", action="store_true", help=f"use the hardest houses: {HARD}")
    args = parser.parse_args()
    kwargs = HARD if args.hard else {}
    report = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "difficulty": kwargs,
        "rounds": args.rounds,
        "gold": gold_rollouts(make_env("minisci", **kwargs), args.rounds),
        "random_valid": random_rollouts(make_env("minisci", **kwargs), args.rounds, args.seed),
        "random_valid_no_focus": random_rollouts(
            make_env("minisci", **kwargs), args.rounds, args.seed, allow_focus=False
        ),
    }
    gold, rand = report["gold"], report["random_valid"]
    print(f"gold:   {gold['steps_per_s']:9.0f} steps/s (step only), {gold['resets_per_s']:7.0f} resets/s")
    print(
        f"random: {rand['steps_per_s']:9.0f} steps/s (step only), "
        f"{rand['steps_per_s_with_valid_actions']:7.0f} steps/s with valid_actions()"
    )
    explore = report["random_valid_no_focus"]["mean_score"]
    for family, mean in rand["mean_score"].items():
        wrong = rand["failed_by_wrong_focus"][family]
        print(
            f"random mean score {family:20s} {mean:5.1f} (ended by a wrong focus: {wrong:4.0%}); "
            f"without focus actions {explore[family]:5.1f}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

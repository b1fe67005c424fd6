"""How hard MiniSci is for a policy, per house difficulty and family: the numbers used to size a CPU experiment.

For each difficulty setting (`--settings`, each a comma list of env overrides such as
`num_rooms=4,num_decoys=1`) and each family, group rollouts of training variations are played by

- `random`: a uniformly random valid action at every step (no model), and
- `policy`: the configured LLM through the real collector (memory off, training temperature).

Per (setting, family, player) the table gives the mean score (0-100), the success rate, the share of
episodes that end on a wrong `focus on`, and, the number that decides whether group-relative RL
can learn at all, the share of groups whose rollouts do not all score the same (a group with equal
returns has zero advantage everywhere and teaches nothing). Prints a table and writes JSON.

    python benchmarks/minisci_calibration.py [--model smollm2|minisci_bc] [--groups 4] [--group-size 4]
        [--max-steps 8] [--settings "" "num_rooms=4,num_decoys=1"] [--families find-living-thing]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from empo2.config import load_config
from empo2.envs import get_catalogue, make_env
from empo2.envs.minisci import FAMILIES
from empo2.models import load_policy
from empo2.train import build_collector, env_kwargs


def parse_setting(text: str) -> list[str]:
    return [f"env.{kv.strip()}" for kv in text.split(",") if kv.strip()]


def summarise(scores: list[list[float]], wrong_focus: int, seconds: float) -> dict:
    """scores: one list of episode scores per group."""
    flat = [s for group in scores for s in group]
    return {
        "episodes": len(flat),
        "mean_score": statistics.fmean(flat),
        "success": sum(s == 100 for s in flat) / len(flat),
        "wrong_focus": wrong_focus / len(flat),
        "groups_with_signal": sum(len(set(g)) > 1 for g in scores) / len(scores),
        "seconds_per_episode": seconds / len(flat),
    }


def play_random(cfg, tasks, group_size: int, seed: int) -> dict:
    rng = random.Random(seed)
    env = make_env("minisci", **env_kwargs(cfg))
    scores, wrong, t0 = [], 0, time.perf_counter()
    for spec in tasks:
        group = []
        for _ in range(group_size):
            env.reset(task=spec.task, variation=spec.variation)
            info = {"score": 0, "failed": False}
            for _ in range(cfg.env.max_steps):
                result = env.step(rng.choice(env.valid_actions()))
                info = result.info
                if result.done:
                    break
            group.append(float(info["score"]))
            wrong += bool(info["failed"])
        scores.append(group)
    return summarise(scores, wrong, time.perf_counter() - t0)


def play_policy(cfg, model, tok, tasks, group_size: int, seed: int) -> dict:
    collector = build_collector(cfg, model, tok, len(tasks) * group_size)
    t0 = time.perf_counter()
    batch = collector.collect(tasks, group_size, iteration=0, generator=torch.Generator().manual_seed(seed))
    seconds = time.perf_counter() - t0
    by_group: dict[int, list[float]] = {}
    for tr in batch.trajectories:
        by_group.setdefault(tr.group_id, []).append(float(tr.score))
    # A MiniSci episode ends before its step budget only when it is won or failed (a wrong focus).
    wrong = sum(tr.length < cfg.env.max_steps and not tr.won for tr in batch.trajectories)
    out = summarise(list(by_group.values()), wrong, seconds)
    out["invalid_action_frac"] = batch.stats["rollout/invalid_action_frac"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="a conf/model group: smollm2, minisci_bc, tiny")
    ap.add_argument("--settings", nargs="+", default=["", "num_rooms=4,num_decoys=1,num_distractors=1"],
                    help='house overrides per setting, e.g. "num_rooms=4,num_decoys=0"; "" is the default house')
    ap.add_argument("--families", nargs="+", default=[f for f in FAMILIES if f != "change-state"])
    ap.add_argument("--groups", type=int, default=4, help="task instances per family (train split)")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-steps", type=int, default=8)
    ap.add_argument("--random-groups", type=int, default=50, help="task instances per family for the random player")
    ap.add_argument("--no-policy", action="store_true", help="random player only")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "minisci_calibration.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    base = [f"model={args.model}", "memory.enabled=false", "algo.p=0",
            f"env.max_steps={args.max_steps}", "rollout.max_new_tokens=16"]
    model = tok = None
    if not args.no_policy:
        model, tok = load_policy(load_config(base).model)
        model.eval()
    cat = get_catalogue("minisci")
    rows = []
    for setting in args.settings:
        cfg = load_config(base + parse_setting(setting))
        for family in args.families:
            for player in ("random",) + (() if args.no_policy else ("policy",)):
                n = args.random_groups if player == "random" else args.groups
                tasks = cat.sample(n, "train", seed=args.seed, tasks=[family])
                res = (play_random(cfg, tasks, args.group_size, args.seed) if player == "random" else
                       play_policy(cfg, model, tok, tasks, args.group_size, args.seed))
                rows.append({"setting": setting or "default", "family": family, "player": player, **res})
                r = rows[-1]
                print(f"| {r['setting']} | {family} | {player} | {r['mean_score']:.1f} | {r['success']:.2f} | "
                      f"{r['wrong_focus']:.2f} | {r['groups_with_signal']:.2f} | {r['seconds_per_episode']:.3f} |",
                      flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": platform.platform(), "processor": platform.processor(),
                               "threads": args.threads, "args": vars(args), "rows": rows}, indent=2))
    print(f"columns: setting | family | player | mean score | success | wrong focus | groups with signal | "
          f"s/episode\nwrote {out}")


if __name__ == "__main__":
    main()

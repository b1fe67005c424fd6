"""What a tip in the prompt changes in a `minisci-tips` reader's first move on find-living-thing: the trap there is a
look-alike in the starting room (or the room the prior heads for), so a reader that focuses on its first move has
taken it. Plays the calibration's 72 training instances tip-free and with one gold-path tip of a power-component
instance in memory (another task's: nothing in it applies; keyed as the instance's own gold path's tip, as the
calibration's `other_task` column), one tip per prompt by score as in the headline grid, and prints per condition
the score, how many first moves are a focus, how many go to a room the tip names, and the share of episodes ending
on a wrong focus.

    python benchmarks/minisci_tips_first_move.py [--override model.name=hf model.path=DIR model.dtype=float32]
"""

from __future__ import annotations

import argparse

import torch

from empo2.config import load_config
from empo2.envs import get_catalogue, make_env
from empo2.memory import TipMemory
from empo2.models import load_policy
from empo2.prior_tips import hindsight_tip, play
from empo2.train import build_collector, env_kwargs

HOUSE = {"num_rooms": 4, "num_decoys": 1, "num_distractors": 1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--instances", type=int, default=72)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--override", nargs="+", default=[], help="more config overrides, last")
    args = ap.parse_args()
    torch.set_num_threads(2)
    cfg = load_config(["model=minisci_tips_reader", "algo.p=1", "algo.q=0", "algo.beta_start=0", "algo.beta_end=0",
                       "env.max_steps=10", "rollout.max_new_tokens=16", f"seed={args.seed}", "memory.top_k=1",
                       "memory.rank_by=score", *[f"env.{k}={v}" for k, v in HOUSE.items()], *args.override])
    model, tok = load_policy(cfg.model)
    model.eval()
    cat = get_catalogue("minisci")
    tasks = cat.sample(args.instances, "train", seed=args.seed, tasks=["find-living-thing"])
    donors = cat.sample(args.instances, "train", seed=args.seed, tasks=["power-component"])
    env = make_env("minisci", **{**env_kwargs(cfg), "max_steps": 100})
    collector = build_collector(cfg, model, tok, len(tasks))
    collector.settings.write_tips = False
    like = collector.memory
    memories = {"tip-free": TipMemory(like.dim, **{k: v for k, v in like.config().items() if k != "dim"}),
                "another task's tip": TipMemory(like.dim, **{k: v for k, v in like.config().items() if k != "dim"})}
    texts, keys, metas, named = [], [], [], []
    for spec, donor in zip(tasks, donors):
        env.reset(task=donor.task, variation=donor.variation)
        ep = play(env, donor.task, donor.variation, HOUSE, env.gold_actions(), cfg.env.max_steps)
        texts.append(hindsight_tip(ep))
        named.append(set(ep.sightings.values()))
        env.reset(task=spec.task, variation=spec.variation)
        own = play(env, spec.task, spec.variation, HOUSE, env.gold_actions(), cfg.env.max_steps)
        keys.append(collector._key_text(env, own.turns, own.final_obs))
        metas.append({"task": spec.task, "variation": spec.variation, "episode_return": ep.score / 100})
    memories["another task's tip"].add(texts, collector.embedder.encode(keys), metas)
    n = len(tasks)
    for name, memory in memories.items():
        collector.memory = memory
        generator = torch.Generator().manual_seed(args.seed)
        trajs = collector.collect(tasks, 1, iteration=0, generator=generator).trajectories
        firsts = [tok.decode(tr.samples[0].response_ids, skip_special_tokens=True).strip() for tr in trajs]
        focus = sum(f.startswith("focus on") for f in firsts)
        to_named = sum(any(f == f"go to {room}" for room in rooms) for f, rooms in zip(firsts, named))
        wrong = sum(tr.length < cfg.env.max_steps and not tr.won for tr in trajs)
        print(f"{name}: score {sum(tr.score for tr in trajs) / n:.1f}, first move a focus {focus}/{n}, "
              f"to a room the tip names {to_named}/{n}, ends on a wrong focus {wrong}/{n}")


if __name__ == "__main__":
    from empo2.cli import quiet_libraries

    quiet_libraries()
    main()

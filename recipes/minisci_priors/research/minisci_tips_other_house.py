"""Does a tip about another house act by what it says? The calibration's "another house" columns, split by
what the tip names.

On find-living-thing the calibration gives each instance the gold path's tip of the next instance of the family
(another house) and, separately, the tips the policy wrote for that next instance. The gold path's tip names the
next instance's sought thing (the policy's own tips name it when they are true). Whether it could apply here
depends on that thing: the same sought thing (it could be
true, in another room), this house's look-alike (it points at the trap), a thing of the category the task asks
for (an animal for "find an animal": plausible, this house may hold it), or a thing of another category (a plant
for "find an animal": it cannot apply). A policy that reads what a tip says should be moved by the first three
and not by the last. Reads calibration records (`recipes/minisci_priors/minisci_calibration.py --memory`), rebuilds
their instances from the recorded arguments and prints, per kind, the mean scores with paired 95% bootstrap intervals
of the change. Nothing is played.

    python -m recipes.minisci_priors.research.minisci_tips_other_house \\
        reports/minisci_priors/calibration_reader_v6_top1_score.json ...
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from empo2.algo.stats import bootstrap_ci
from empo2.envs import get_catalogue
from empo2.envs.minisci.env import build
from empo2.envs.minisci.layout import Difficulty

FAMILY = "find-living-thing"
KINDS = ("the same sought thing", "this house's look-alike", "a thing of the task's category",
         "a thing of another category")


def tip_kinds(groups: int, seed: int, setting: str) -> list[str]:
    """For each of the calibration's instances, what the next instance's tip names, as seen from this one."""
    house = {k.strip(): int(v) for k, v in (kv.split("=") for kv in setting.split(",") if kv.strip())}
    specs = get_catalogue("minisci").sample(groups, "train", seed=seed, tasks=[FAMILY])
    tasks = [build(s.task, s.variation, Difficulty(**house))[1] for s in specs]
    kinds = []
    for i, task in enumerate(tasks):
        named = tasks[(i + 1) % len(tasks)].target
        kinds.append(KINDS[0] if named in task.sought else KINDS[1] if named in task.lookalikes
                     else KINDS[2] if named in task.candidates else KINDS[3])
    return kinds


def change(tip_free: np.ndarray, with_tip: np.ndarray, seed: int) -> str:
    if len(tip_free) < 2:
        return f"{with_tip.mean():.1f} ({with_tip.mean() - tip_free.mean():+.1f})"
    mean, lo, hi = bootstrap_ci(np.stack([tip_free, with_tip], axis=1), seed=seed,
                                stat=lambda d: d[:, 1].mean() - d[:, 0].mean())
    return f"{with_tip.mean():.1f} ({mean:+.1f} [{lo:+.1f}, {hi:+.1f}])"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("records", nargs="+", help="calibration JSON files written with --memory")
    args = ap.parse_args()
    print("| record | the tip names | instances | tip-free | another house's gold tip (change) | "
          "its own tips of the next instance (change) |\n|---|---|---|---|---|---|")
    for path in args.records:
        record = json.load(open(path))
        seed = record["args"]["seed"]
        for row in (r for r in record["rows"] if r["family"] == FAMILY):
            kinds = np.array(tip_kinds(len(row["scores"][0]), seed, row["setting"]))
            tip_free = np.array(row["scores"][0], dtype=float)
            other_house = np.array(row["other_house_tip_scores"], dtype=float)
            own_next = np.array(row["irrelevant_scores"], dtype=float)
            for kind in KINDS:
                idx = kinds == kind
                if idx.any():
                    print(f"| {path.rsplit('/', 1)[-1]} | {kind} | {idx.sum()} | {tip_free[idx].mean():.1f} | "
                          f"{change(tip_free[idx], other_house[idx], seed)} | "
                          f"{change(tip_free[idx], own_next[idx], seed)} |")


if __name__ == "__main__":
    main()

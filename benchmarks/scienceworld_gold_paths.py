"""Longest ScienceWorld gold path per task, in the adapter's own steps, against the step budgets.

For every task (all 30) this measures, under the simplification "easy" the project uses:

- every variation of the package's train split: `env.train_variations` is null (sample from every
  train variation) in conf/env/scienceworld.yaml and no preset in experiments/ sets it (the released
  code's first 5 are a subset; `--train 5` measures only those);
- the first 20 variations of the test split: `env.val_split` is "test" and the largest
  `env.val_variations` of any preset is 20 (empo2_paper, and empo2_official through it; the
  released code validates on the first 20 test variations too).

A task with fewer variations in a split contributes all it has. Each (task, variation) asks the
package for its gold action sequence, then plays it through `ScienceWorldTextEnv` (the project's
adapter) with an unlimited budget, counting the adapter's steps until the episode ends. That count,
`steps`, is what a budget must cover, and it differs from the raw sequence length `raw_len`:
the adapter answers ambiguity prompts itself (the gold path's "0" entries are skipped, as in
tests/integration/test_scienceworld.py), and some gold paths carry actions after the task is already
complete (grow-plant variation 0: 63 actions, won after 28).

The gold path is not fixed: the simulator draws it again at every load, and its length varies
(boil test variation 22: 190 steps in one load, 172-173 in four others). A gold path that does not
end won at score 100 is tried once more on a fresh load; one that fails twice is listed under
"failures" (the package's own gold path fails there too, e.g. measure-melting-point-unknown-substance
train variation 10 focuses on the wrong box; freeze train variation 11 ends unfrozen at 87). `max`
is over every played path, won or not.

One JVM serves the whole run (a load is ~0.5-2 s, 8-13 s for the mendelian-genetics tasks, whose
gold path is slow to generate): 4,053 task instances, ~100 min on a loaded 2-core machine, two
thirds of it the 340 mendelian-genetics ones. Writes benchmarks/results/scienceworld_gold_paths.json
(rewritten after every task, so an interrupted run keeps what it measured) and prints a table of max /
median steps per task against
the current `TASK_BUDGETS`.

Usage: `python benchmarks/scienceworld_gold_paths.py [--train N] [--test 20] [--tasks a b ...]
[--out PATH]` (`--train` defaults to every train variation).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

from empo2.envs.scienceworld import TASK_BUDGETS, TASKS, EnvError, ScienceWorldTextEnv, catalogue
from empo2.utils import atomic_write_json

SIMPLIFICATION = "easy"
DEFAULT_OUT = Path(__file__).parent / "results" / "scienceworld_gold_paths.json"
UNLIMITED = 10_000  # a budget no gold path reaches: the measurement must not be truncated


def play_gold(env: ScienceWorldTextEnv, task: str, variation: int) -> dict:
    """A fresh gold path of one task instance, played through the adapter until the episode ends."""
    gold = env.gold_actions(task, variation)
    env.reset(task, variation)
    steps, last = 0, None
    for action in gold:
        if action == "0":  # answers an ambiguity prompt, which the adapter answers itself
            continue
        last = env.step(action)
        steps += 1
        if last.done:
            break
    info = last.info if last is not None else {}
    return {"variation": variation, "raw_len": len(gold), "steps": steps,
            "score": info.get("score"), "won": bool(info.get("won")),
            "done": bool(last is not None and last.done)}


def measure(env: ScienceWorldTextEnv, task: str, variation: int, tries: int = 2) -> dict:
    """`play_gold`, tried again on a fresh load while the path does not win (at most `tries`)."""
    for attempt in range(1, tries + 1):
        try:
            rec = play_gold(env, task, variation)
        except (EnvError, ValueError) as err:
            rec = {"variation": variation, "error": str(err), "won": False}
        rec["attempts"] = attempt
        if rec["won"]:
            break
    return rec


def summarise(records: list[dict]) -> dict:
    played = [r for r in records if "steps" in r]
    out: dict = {"count": len(records), "won": sum(r["won"] for r in records)}
    if played:
        top = max(played, key=lambda r: (r["steps"], -r["variation"]))
        raw_top = max(played, key=lambda r: (r["raw_len"], -r["variation"]))
        out.update(max=top["steps"], median=float(statistics.median(r["steps"] for r in played)),
                   max_variation=top["variation"], max_split=top["split"],
                   raw_len_max=raw_top["raw_len"], raw_len_max_variation=raw_top["variation"])
    out["failures"] = [r for r in records if not r["won"]]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--train", type=int, default=None, help="first N train variations per task (default: all)")
    ap.add_argument("--test", type=int, default=20, help="first N test variations per task")
    ap.add_argument("--tasks", nargs="*", default=list(TASKS))
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()

    cat = catalogue()
    payload: dict = {
        "benchmark": "scienceworld_gold_paths", "simplification": SIMPLIFICATION,
        "variations": {"train": "all" if args.train is None else f"first {args.train}",
                       "test": f"first {args.test}"},
        "metric": "steps = adapter steps the package's gold path takes to end the episode",
        "platform": platform.platform(), "tasks": {},
    }
    t_start = time.monotonic()
    env = ScienceWorldTextEnv(simplification=SIMPLIFICATION, max_steps=UNLIMITED)
    try:
        for task in args.tasks:
            t0 = time.monotonic()
            records = []
            for split, n in (("train", args.train), ("test", args.test)):
                for variation in cat.split(task, split)[:n]:
                    records.append({"split": split, **measure(env, task, variation)})
            summary = summarise(records)
            summary["budget_at_measurement"] = TASK_BUDGETS[task]
            summary["seconds"] = round(time.monotonic() - t0, 1)
            payload["tasks"][task] = summary
            payload["seconds"] = round(time.monotonic() - t_start, 1)
            atomic_write_json(args.out, payload)
            print(f"{task}: max {summary.get('max')} ({summary['won']}/{summary['count']} won, "
                  f"{summary['seconds']} s)", flush=True)
    finally:
        env.close()

    print(f"\n{'task':50s} {'n':>4s} {'max':>4s} {'median':>6s} {'at':>10s} {'raw':>4s} {'budget':>6s}")
    for task, s in payload["tasks"].items():
        at = f"{s.get('max_split')}/{s.get('max_variation')}"
        flag = "  < gold" if s.get("max", 0) > s["budget_at_measurement"] else ""
        flag += f"  {len(s['failures'])} not won" if s["failures"] else ""
        print(f"{task:50s} {s['count']:4d} {s.get('max', '-')!s:>4s} {s.get('median', '-')!s:>6s} {at:>10s} "
              f"{s.get('raw_len_max', '-')!s:>4s} {s['budget_at_measurement']:6d}{flag}")
    print(f"\nwrote {args.out} ({payload['seconds']} s)")


if __name__ == "__main__":
    main()

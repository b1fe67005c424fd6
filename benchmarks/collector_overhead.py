"""Share of rollout wall time the rollout worker itself costs (everything but generation), bundled SmolLM2 on MiniSci.

One `RolloutWorker.collect` with the default CPU config (prompt building, retrieval, environment
steps, novelty counting, tip sanitising/embedding/insertion, advantages) is timed by the worker's
own split: generate (actions), tips (tip generation), env (steps), memory (retrieval, tip sanitising,
embedding and insertion). The overhead is rollout time minus action and tip generation. A second
batch runs with a filled memory and p=1 so retrieval is exercised. Prints a table and writes JSON.

    python benchmarks/collector_overhead.py [--out benchmarks/results/collector_overhead.json] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from empo2.config import load_config
from empo2.envs import get_catalogue
from empo2.models import load_policy
from empo2.rollout.build import build_worker
from empo2.rollout.spec import collection_spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "collector_overhead.json"))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config([])
    model, tok = load_policy(cfg.model)
    n = cfg.rollout.tasks_per_batch * cfg.rollout.group_size
    worker = build_worker(cfg, model, tok, n)
    tasks = get_catalogue("minisci").sample(cfg.rollout.tasks_per_batch, "train", seed=0, variations=1)
    rows = []
    for label, p in (("memory empty", cfg.algo.p), ("memory filled, p=1", 1.0)):
        stats = worker.collect(collection_spec(cfg, p=p), tasks, cfg.rollout.group_size, 0,
                               torch.Generator().manual_seed(0)).stats
        total = stats["time/rollout_s"]
        overhead = total - stats["time/generate_s"] - stats["time/tips_s"]
        rows.append({"batch": label, "rollout_s": total, "generate_s": stats["time/generate_s"],
                     "tips_s": stats["time/tips_s"], "env_s": stats["time/env_s"], "memory_s": stats["time/memory_s"],
                     "overhead_s": overhead, "overhead_share": overhead / total,
                     "memory_frac": stats["rollout/memory_frac"], "tokens": stats["rollout/tokens_generated"]})
    for env in worker.envs:
        env.close()
    print(f"{'batch':<20} {'rollout s':>9} {'generate s':>10} {'tips s':>7} {'env s':>6} {'memory s':>8} "
          f"{'overhead':>9}")
    for r in rows:
        print(f"{r['batch']:<20} {r['rollout_s']:9.2f} {r['generate_s']:10.2f} {r['tips_s']:7.2f} {r['env_s']:6.3f} "
              f"{r['memory_s']:8.3f} {100 * r['overhead_share']:8.2f}%")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": platform.platform(), "threads": args.threads, "rows": rows}, indent=2))
    print(f"written: {out}")


if __name__ == "__main__":
    from empo2.utils import quiet_libraries

    quiet_libraries()  # weight-loading bars and INFO lines off, as in the CLI
    main()

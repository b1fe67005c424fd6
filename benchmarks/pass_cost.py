"""What one more decoder pass costs the CPU update, in positions: the constant `length_buckets` weighs padding
against passes with (`empo2.lit.packing.PASS_COST`).

For each model, the forward and backward of one right-padded row as the update runs it (no mask, logits kept at
its last 13 positions, every parameter's `.grad` already allocated, as after a micro-batch's first pass) at
several widths; the widths alternate within each repeat, so load from other processes falls on all, and the
fastest repeat of each is kept. A least-squares line through them gives the cost per position (slope) and per
pass (intercept); their ratio is the pass's cost in positions. As a check, two rows of one width run as one pass
and as two. Prints a table and writes JSON.

    python benchmarks/pass_cost.py [--models smollm2 minisci_bc] [--widths 64 128 192 256 320 384]
        [--repeats 4] [--threads 2] [--out benchmarks/results/pass_cost.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import time
from pathlib import Path

import torch

from empo2.utils import quiet_libraries


def _pass_seconds(model, g: torch.Generator, batch: int, width: int) -> float:
    """Forward and backward of one right-padded pass of `batch` random rows of `width` tokens."""
    ids = torch.randint(3, model.config.vocab_size, (batch, width), generator=g)  # (batch, width)
    start = time.perf_counter()
    logits = model(input_ids=ids, use_cache=False, logits_to_keep=torch.arange(width - 13, width)).logits
    logits.float().logsumexp(-1).sum().backward()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2", "minisci_bc"], help="model presets")
    ap.add_argument("--widths", nargs="+", type=int, default=[64, 128, 192, 256, 320, 384])
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/pass_cost.json")
    args = ap.parse_args()
    quiet_libraries()  # before transformers is imported: its weight-loading bars read the setting once
    from empo2.config import load_config
    from empo2.lit.packing import PASS_COST
    from empo2.models import load_policy

    torch.set_num_threads(args.threads)
    rows = []
    print(f"(the update weighs a pass as {PASS_COST} positions)\n"
          "| model | per position ms | per pass ms | pass in positions | 2 rows of 128: one pass / two passes s |\n"
          "|---|---|---|---|---|")
    for preset in args.models:
        model, _ = load_policy(load_config([f"model={preset}"]).model)
        model.train()
        g = torch.Generator().manual_seed(0)
        step = functools.partial(_pass_seconds, model, g)
        step(1, args.widths[0])  # allocates every .grad
        best = dict.fromkeys(args.widths, float("inf"))
        together = apart = float("inf")
        for _ in range(args.repeats):
            for w in args.widths:
                best[w] = min(best[w], step(1, w))
            together = min(together, step(2, 128))
            apart = min(apart, step(1, 128) + step(1, 128))
        xs = torch.tensor(args.widths, dtype=torch.float64)
        ys = torch.tensor([best[w] for w in args.widths], dtype=torch.float64)
        slope = float(((xs - xs.mean()) * (ys - ys.mean())).sum() / ((xs - xs.mean()) ** 2).sum())
        intercept = float(ys.mean() - slope * xs.mean())
        row = {"model": preset, "parameters": sum(p.numel() for p in model.parameters()),
               "seconds_by_width": best, "per_position_s": slope, "per_pass_s": intercept,
               "pass_in_positions": intercept / slope, "two_rows_one_pass_s": together, "two_rows_two_passes_s": apart}
        rows.append(row)
        print(f"| {preset} | {1e3 * slope:.3f} | {1e3 * intercept:.1f} | {intercept / slope:.0f} | "
              f"{together:.3f} / {apart:.3f} |", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": platform.platform(), "threads": args.threads, "torch": torch.__version__,
                               "widths": args.widths, "repeats": args.repeats, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""Seconds per AdamW step on a CPU: torch's default kernel against the module's (`empo2.lit.module.adamw`, fused).

For each model, two copies of its parameters with the same random gradients each step; the two optimisers
alternate step by step, so load from other processes falls on both. The first step is reported apart (it
allocates the moment estimates, ~1 GB for SmolLM2-135M, the same for both kernels); the median of the later
steps is the steady cost, and the ratio default / fused its speed-up. Prints a table and writes JSON.

    python benchmarks/optimizer_step.py [--models smollm2 minisci_bc] [--steps 8] [--threads 2]
        [--out benchmarks/results/optimizer_step.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from empo2.utils import quiet_libraries


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2", "minisci_bc"], help="model presets")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/optimizer_step.json")
    args = ap.parse_args()
    quiet_libraries()  # before transformers is imported: its weight-loading bars read the setting once
    from empo2.config import load_config
    from empo2.lit.module import adamw
    from empo2.models import load_policy

    torch.set_num_threads(args.threads)
    rows = []
    print("| model | parameters | first step: default / fused s | later steps (median): default / fused s | ratio |\n"
          "|---|---|---|---|---|")
    for preset in args.models:
        model, _ = load_policy(load_config([f"model={preset}"]).model)
        copies = {"default": copy.deepcopy(model), "fused": model}
        opts = {"default": torch.optim.AdamW(copies["default"].parameters(), lr=1e-5),
                "fused": adamw(list(model.parameters()), lr=1e-5, weight_decay=0.0)}
        times: dict[str, list[float]] = {k: [] for k in opts}
        g = torch.Generator().manual_seed(0)
        for _ in range(args.steps):
            grads = [torch.randn(p.shape, generator=g) for p in model.parameters()]
            for name, opt in opts.items():
                for p, grad in zip(copies[name].parameters(), grads):
                    p.grad = grad
                start = time.perf_counter()
                opt.step()
                times[name].append(time.perf_counter() - start)
        later = {k: statistics.median(v[1:]) for k, v in times.items()}
        row = {"model": preset, "parameters": sum(p.numel() for p in model.parameters()),
               "first_s": {k: v[0] for k, v in times.items()}, "later_median_s": later,
               "ratio": later["default"] / later["fused"]}
        rows.append(row)
        print(f"| {preset} | {row['parameters'] / 1e6:.1f}M | {times['default'][0]:.3f} / {times['fused'][0]:.3f} | "
              f"{later['default']:.4f} / {later['fused']:.4f} | {row['ratio']:.1f}x |", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": platform.platform(), "threads": args.threads, "torch": torch.__version__,
                               "steps": args.steps, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

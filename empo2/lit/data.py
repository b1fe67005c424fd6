"""The rollout buffer and the stream of mini-batches the Lightning module trains on.

Every pass over `RolloutDataModule`'s IterableDataset is one iteration: it first asks the Trainer's rollout
source (the callback with `produce_iteration`: `RolloutCallback`) to fill the buffer with fresh rollouts, then
yields the micro-batches of `ppo_epochs` shuffled passes of mini-batches over them. Producing on iteration
rather than in an epoch-start hook matters: Lightning creates (and prefetches from) the first epoch's iterator before
`on_train_epoch_start`, both on a fresh start and on resume, so a hook-filled buffer would be read
while still empty. Each rank streams its own buffer (its own share of the rollouts) and the plan
`set_rollouts` made for it: under data parallelism every rank's plan has the same number of optimiser steps
and backward passes, so collective ops never wait on a rank that ran out of data, and normalises each
mini-batch's loss by the global mini-batch's counts.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from empo2.rollout.types import StepSample


@dataclass
class RolloutBuffer:
    samples: list[StepSample] = field(default_factory=list)
    old_logprobs: list[torch.Tensor] = field(default_factory=list)  # per sample (T_i,), behaviour prompt
    iteration: int = 0
    # the iteration's mini-batches of micro-batches, all `ppo_epochs` passes in order (`plan_iteration`), made
    # once by `RolloutDataModule.set_rollouts` and streamed as they are; empty when the update is skipped
    plan: list[list[MicroBatch]] = field(default_factory=list)


def collate(samples: list[StepSample], pad_id: int, prompt: str = "train") -> dict[str, torch.Tensor]:
    """Prompt + response token ids as one batch, prompts LEFT-padded and responses RIGHT-padded, so
    every response starts at the same column P and the model's logits can be kept for the last T+1
    positions only (no full-vocabulary logits over prompt tokens).

    prompt: "train" (the learner's prompt: tip-free for off-policy samples) or "behaviour".
    Returns input_ids/attention_mask/position_ids (B, P+T), response_ids/response_mask (B, T) and
    prefix_len (B,): the shared system and task part of each prompt (`StepSample.prefix_len`).
    """
    prompts = [s.train_ids if prompt == "train" else s.behaviour_ids for s in samples]
    P = max(len(p) for p in prompts)
    T = max(len(s.response_ids) for s in samples)
    B = len(samples)
    input_ids = torch.full((B, P + T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, P + T), dtype=torch.long)
    response_mask = torch.zeros((B, T), dtype=torch.bool)
    for b, (p, s) in enumerate(zip(prompts, samples)):
        r = s.response_ids
        input_ids[b, P - len(p):P] = torch.tensor(p, dtype=torch.long)
        input_ids[b, P:P + len(r)] = torch.tensor(r, dtype=torch.long)
        attention_mask[b, P - len(p):P + len(r)] = 1
        response_mask[b, :len(r)] = True
    # left padding shifts positions: count only real tokens so a prompt is encoded the same padded or not
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (B, P+T)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
            "response_ids": input_ids[:, P:], "response_mask": response_mask,
            "prefix_len": torch.tensor([s.prefix_len for s in samples], dtype=torch.long)}


def derive_seed(*parts: int) -> int:
    """A seed for one (run seed, iteration, ...) tuple: each draw depends only on where it happens, so a
    resumed run replays exactly the draws of an uninterrupted one."""
    seed = 0
    for p in parts:
        seed = (seed * 1_000_003 + int(p)) % (2**63 - 1)
    return seed


def pad_logprobs(rows: list[torch.Tensor], T: int) -> torch.Tensor:
    """Stack per-sample (T_i,) log-prob rows into (B, T), zero-padded on the right."""
    out = torch.zeros((len(rows), T), dtype=torch.float32)
    for b, r in enumerate(rows):
        out[b, :len(r)] = r
    return out


@dataclass
class MicroBatch:
    """One forward/backward: `indices` into the buffer; the optimiser steps after the micro-batch with
    `last` set. `num_tokens` and `num_seqs` are the valid response tokens and the responses of the whole
    mini-batch, known before any micro-batch runs: the loss normalises by them, so the micro-batch losses
    add up to the mini-batch loss however the mini-batch is split. Under data parallelism they are those of
    the global mini-batch, every rank's k-th mini-batch together (`with_normalisers`), so the rank losses add
    up to its loss however the samples are spread over ranks. `weight` is 0 for the padding
    micro-batches that only keep ranks in step (their gradient is exactly zero), else 1. `closes_iteration`
    marks the iteration's last micro-batch: the module logs the iteration's metrics once, after it."""

    indices: list[int]
    num_tokens: int
    num_seqs: int
    last: bool
    weight: float = 1.0
    closes_iteration: bool = False


def cut_micro_batches(mini: list[int], micro_batch_size: int, lengths: list[int],
                      prompt_lengths: list[int] | None = None, token_budget: int | None = None) -> list[list[int]]:
    """A mini-batch (`mini`: sample indices, in the order to cut) as consecutive micro-batches of at most
    `micro_batch_size` samples and, with `token_budget`, at most that many padded positions each: rows x
    (longest prompt + longest response), the (B, P+T) input `collate` builds, so a forward/backward's
    activations are bounded by the budget instead of by how long the longest samples happen to be. A sample
    whose own size exceeds the budget takes a micro-batch alone (a sequence is never split)."""
    micros: list[list[int]] = []
    current: list[int] = []
    for i in mini:
        grown = current + [i]
        over = token_budget is not None and len(grown) * (max(prompt_lengths[j] for j in grown)
                                                          + max(lengths[j] for j in grown)) > token_budget
        if current and (len(grown) > micro_batch_size or over):
            micros.append(current)
            grown = [i]
        current = grown
    if current:
        micros.append(current)
    return micros


def plan_epoch(lengths: list[int], num_mini_batches: int, micro_batch_size: int, micro_per_mini: int | None,
               generator: torch.Generator, prompt_lengths: list[int] | None = None,
               token_budget: int | None = None) -> list[list[MicroBatch]]:
    """The mini-batches of one PPO epoch over samples with these response lengths: one shuffle, split into
    `num_mini_batches` parts whose sizes differ by at most one, so every sample counts exactly once per
    epoch (a rank with fewer samples than its peers gets smaller mini-batches, never repeated ones).

    With `micro_per_mini` set (data parallelism) every mini-batch has exactly that many micro-batches, and a
    rank with fewer samples than mini-batches still takes part in each step: missing micro-batches are
    zero-weight repeats of one sample, contributing a zero gradient to the all-reduce.

    With `prompt_lengths` a mini-batch is cut into micro-batches in order of padded size (prompt + response
    tokens), so each micro-batch pads to a length close to its own samples'; with `token_budget` too, no
    micro-batch pads to more positions than the budget (`cut_micro_batches`). What a mini-batch holds, and so
    its gradient (the loss is normalised per mini-batch, not per micro-batch), is the same either way; only
    the padding and the size of each forward/backward change.
    """
    if token_budget is not None and prompt_lengths is None:
        raise ValueError("a token budget needs the prompt lengths: the padded size depends on them")
    n = len(lengths)
    order = torch.randperm(n, generator=generator).tolist()
    plan = []
    for k in range(num_mini_batches):  # part k: the same split as numpy's array_split
        lo, hi = k * n // num_mini_batches, (k + 1) * n // num_mini_batches
        mini = order[lo:hi]
        if prompt_lengths is not None:
            mini = sorted(mini, key=lambda i: prompt_lengths[i] + lengths[i])  # stable: ties keep the shuffled order
        micros = cut_micro_batches(mini, micro_batch_size, lengths, prompt_lengths, token_budget)
        weights = [1.0] * len(micros)
        if micro_per_mini is not None:
            if len(micros) > micro_per_mini:
                raise ValueError(f"a mini-batch of {len(mini)} needs {len(micros)} micro-batches, "
                                 f"more than the {micro_per_mini} agreed across ranks")
            pad = micro_per_mini - len(micros)
            micros += [[order[0]]] * pad
            weights += [0.0] * pad
        tokens = sum(lengths[i] for i in mini)
        plan.append([MicroBatch(mb, tokens, len(mini), j == len(micros) - 1, w)
                     for j, (mb, w) in enumerate(zip(micros, weights))])
    return plan


def mini_batch_counts(plan: list[list[MicroBatch]]) -> list[tuple[int, int]]:
    """(valid tokens, responses) of each mini-batch of a plan: a rank's part of the global normalisers."""
    return [(mini[0].num_tokens, mini[0].num_seqs) for mini in plan]


def with_normalisers(plan: list[list[MicroBatch]], normalisers: list[tuple[int, int]]) -> list[list[MicroBatch]]:
    """The plan with each mini-batch's loss normalisers replaced by the global mini-batch's (tokens, responses):
    the sums of every rank's `mini_batch_counts`, mini-batch by mini-batch."""
    if len(normalisers) != len(plan):
        raise ValueError(f"{len(normalisers)} normalisers for a plan of {len(plan)} mini-batches")
    return [[dataclasses.replace(mb, num_tokens=tokens, num_seqs=seqs) for mb in mini]
            for mini, (tokens, seqs) in zip(plan, normalisers)]


def plan_iteration(samples: list[StepSample], iteration: int, num_mini_batches: int, ppo_epochs: int,
                   micro_batch_size: int, token_budget: int | None, micro_per_mini: int | None, seed: int,
                   rank: int) -> list[list[MicroBatch]]:
    """The mini-batches of all `ppo_epochs` passes of one iteration, in order. Each epoch's plan has its own
    seed, a function of (seed, iteration, epoch, rank) only, so a resumed run plans the same."""
    lengths = [len(s.response_ids) for s in samples]
    prompt_lengths = [len(s.train_ids) for s in samples]  # the prompt the update pads
    plan: list[list[MicroBatch]] = []
    for epoch in range(ppo_epochs):
        g = torch.Generator().manual_seed(derive_seed(seed, iteration, epoch, rank))
        plan += plan_epoch(lengths, num_mini_batches, micro_batch_size, micro_per_mini, g, prompt_lengths,
                           token_budget)
    return plan


@runtime_checkable
class RolloutSource(Protocol):
    """What fills the buffer: the Trainer's callback that runs the iteration's rollouts (`RolloutCallback`)."""

    def produce_iteration(self, trainer: L.Trainer) -> None:
        """This iteration's rollouts and old log-probs into the buffer (`RolloutDataModule.set_rollouts`)."""


class _MicroBatchStream(IterableDataset):
    """Yields the micro-batches of the buffer's plan; each pass over the stream produces a new buffer first, so
    one DataLoader serves every iteration.

    One micro-batch per training step keeps exactly one forward and one backward per step, which is
    what DDP's gradient reducer expects."""

    def __init__(self, buffer: RolloutBuffer, source: RolloutSource, trainer: L.Trainer):
        self.buffer, self.source, self.trainer = buffer, source, trainer

    def __iter__(self):
        self.source.produce_iteration(self.trainer)
        for mini in self.buffer.plan:
            yield from mini


def step_counts(busiest: int, world_size: int, mini_batch_size: int, micro_batch_size: int) -> tuple[int, int | None]:
    """(mini-batches per epoch, micro-batches per mini-batch) that every rank runs, set by the busiest rank's
    sample count; on one rank the micro-batch count is left free (None)."""
    n_mini = math.ceil(busiest / mini_batch_size)
    if world_size == 1 or n_mini == 0:
        return n_mini, None
    return n_mini, math.ceil(math.ceil(busiest / n_mini) / micro_batch_size)


class RolloutDataModule(L.LightningDataModule):
    def __init__(self, ppo_epochs: int, mini_batch_size: int, micro_batch_size: int, seed: int,
                 token_budget: int | None = None):
        super().__init__()
        self.buffer = RolloutBuffer()
        self.ppo_epochs, self.seed = ppo_epochs, seed
        self.mini_batch_size, self.micro_batch_size, self.token_budget = mini_batch_size, micro_batch_size, token_budget

    def micro_batches_needed(self, samples: list[StepSample], iteration: int, num_mini_batches: int,
                             rank: int) -> int:
        """The most micro-batches any mini-batch of this rank's iteration is cut into: under a token budget
        the count depends on the samples' sizes, so ranks agree on the largest before the update."""
        plan = plan_iteration(samples, iteration, num_mini_batches, self.ppo_epochs, self.micro_batch_size,
                              self.token_budget, None, self.seed, rank)
        return max((len(mini) for mini in plan), default=0)

    def set_rollouts(self, samples: list[StepSample], old_logprobs: list[torch.Tensor], iteration: int, rank: int = 0,
                     world_size: int = 1, device: torch.device | None = None) -> int:
        """This rank's rollouts and their old log-probs into the buffer, with the plan the stream yields
        (`plan_iteration`), made from what the ranks must agree on before the update (three all-reduces under data
        parallelism, every rank calling): the mini-batches per epoch and micro-batches per mini-batch, set by the
        busiest rank (under a token budget, by the largest cut any rank needs), so collective ops never wait on a
        rank that ran out of data; and the loss normalisers, the valid tokens and responses of each global
        mini-batch (every rank's k-th mini-batch together, counted on the plans themselves).
        Returns the mini-batches per epoch, 0 when no rank has a sample, and 0 on every rank when one rank has none
        (all its steps dropped as overlong, say): its zero-weight padding repeats one of its own samples, so it
        could not take part in the collective steps; the iteration's update is skipped, said in one line."""
        sizes = torch.tensor([len(samples), -len(samples)], device=device)  # one MAX gives the most and the fewest
        if world_size > 1:
            dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
        busiest, fewest = int(sizes[0].item()), -int(sizes[1].item())
        if fewest == 0 < busiest:
            if rank == 0:
                print(f"empo2: iteration {iteration}: a rank has no sample to train on; the update is skipped on "
                      f"every rank", file=sys.stderr, flush=True)
            busiest = 0
        n_mini, micro_per_mini = step_counts(busiest, world_size, self.mini_batch_size, self.micro_batch_size)
        plan = []
        if n_mini > 0:  # n_mini is the same on every rank: all or none of them reduce
            if world_size > 1 and self.token_budget is not None:  # the cut depends on each rank's sample sizes
                need = torch.tensor([self.micro_batches_needed(samples, iteration, n_mini, rank)], device=device)
                dist.all_reduce(need, op=dist.ReduceOp.MAX)
                micro_per_mini = int(need.item())
            plan = plan_iteration(samples, iteration, n_mini, self.ppo_epochs, self.micro_batch_size,
                                  self.token_budget, micro_per_mini, self.seed, rank)
            if world_size > 1:  # on one rank a mini-batch's own counts are the global ones
                counts = torch.tensor(mini_batch_counts(plan), dtype=torch.long, device=device)  # (epochs x n_mini, 2)
                dist.all_reduce(counts, op=dist.ReduceOp.SUM)
                plan = with_normalisers(plan, [(tokens, seqs) for tokens, seqs in counts.tolist()])
            plan[-1][-1].closes_iteration = True
        buf = self.buffer
        buf.samples, buf.old_logprobs, buf.iteration, buf.plan = samples, old_logprobs, iteration, plan
        return n_mini

    def train_dataloader(self) -> DataLoader:
        source = next((cb for cb in self.trainer.callbacks if isinstance(cb, RolloutSource)), None)
        if source is None:
            raise RuntimeError("RolloutDataModule needs a RolloutCallback in the Trainer to produce rollouts")
        stream = _MicroBatchStream(self.buffer, source, self.trainer)
        # batch_size=None: the stream already yields whole micro-batches; no worker processes, the buffer
        # lives in this process and changes every iteration
        return DataLoader(stream, batch_size=None, num_workers=0)

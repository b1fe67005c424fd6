"""`EMPO2Module`: the policy and the EMPO² update, one mini-batch per `training_step`.

The update is the paper's, read top to bottom in `training_step` (one micro-batch per call): score
the response under the *training* prompt (tip-free for off-policy samples), build the loss mask (the
low-probability mask on off-policy tokens), compute the dual-clip PPO loss against the old log-probs
(of the *behaviour* prompt before any update of the iteration: recorded by `generate` where exact, else
scored once per iteration) and accumulate gradients;
after the last micro-batch of a mini-batch, clip and step — unless the loss or gradient is not
finite, in which case the step is skipped and counted.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from empo2.algo import core_algos
from empo2.config import AlgoConfig, TrainerConfig
from empo2.lit.data import MicroBatch, RolloutBuffer, collate, pad_logprobs
from empo2.lit.packing import packed_response_logits
from empo2.lit.strategy import FSDP2Strategy, float32_master_weights, is_sharded, reshard
from empo2.rollout.types import StepSample
from empo2.utils import release_free_memory
from empo2.utils.errors import NonFiniteLossError
from empo2.utils.faults import maybe_fail

NONFINITE_CHECKPOINT = "nonfinite.ckpt"


def adamw(params: list[torch.nn.Parameter], lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW, fused when the parameters live on a CPU. There torch defaults to its `foreach` kernels, which
    allocate whole-model temporaries; the fused kernel is several times faster (`benchmarks/optimizer_step.py`,
    docs/performance.md). The same update to float32 rounding; a checkpoint
    restores the choice with the optimiser state, so a resume stays bit-exact. On a GPU torch's default is kept."""
    fused = all(p.device.type == "cpu" for p in params) or None
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused)


class EMPO2Module(L.LightningModule):
    def __init__(self, policy, tokenizer, algo: AlgoConfig, trainer_cfg: TrainerConfig, buffer: RolloutBuffer,
                 ref_policy=None, temperature: float = 1.0):
        super().__init__()
        self.automatic_optimization = False  # micro-batch accumulation and the non-finite guard are explicit
        self.policy = policy
        self.ref_policy = ref_policy  # frozen, only when algo.kl_coef > 0 (LoRA: the base with adapters off)
        self.pad_id = tokenizer.pad_token_id
        self.algo, self.tcfg, self.buffer = algo, trainer_cfg, buffer
        # the rollout temperature: responses were sampled from softmax(logits / T), so ratios, the delta mask
        # and the entropy are judged on that distribution (as verl does), not on T = 1
        self.temperature = temperature
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self._totals: dict[str, float] = {}  # metrics of the current mini-batch, weighted by token share
        # per-iteration sums and step counts of the logged metrics: one `log_dict` per iteration, since each
        # Lightning log call costs more per key than the rest of a small model's optimiser step
        self._iteration: dict[str, list[float]] = {}
        self.last_step: dict[str, float] = {}  # actor/* of the latest optimiser step (MLflow gets iteration means)

    # ------------------------------------------------------------------------------------ log-probs
    def response_logprobs(self, batch: dict[str, torch.Tensor], model=None, with_entropy: bool = False,
                          passes: list | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """log pi_T(response token | prompt, previous response tokens), (B, T), float32, where pi_T is the
        sampling distribution softmax(logits / temperature); with `with_entropy` also its entropy, (B, T).

        Responses start at the same column P (see `collate`), so the LM head runs on the last T+1
        positions only: no full-vocabulary logits over prompt tokens. `passes`: see `_response_logits`.
        """
        model = model or self.policy
        logits = self._response_logits(model, batch, passes)  # (B, T+1, V): position P-1+j predicts token j
        logits = logits[:, :-1].float()  # (B, T, V)
        if self.temperature != 1.0:
            logits = logits / self.temperature
        logp = torch.log_softmax(logits, dim=-1)
        token_logp = logp.gather(-1, batch["response_ids"].unsqueeze(-1)).squeeze(-1)  # (B, T)
        if with_entropy:
            return token_logp, core_algos.entropy_from_logits(logits)
        return token_logp

    @staticmethod
    def _response_logits(model, batch: dict[str, torch.Tensor], passes: list | None = None) -> torch.Tensor:
        """The logits of the last T+1 columns of the left-padded batch, (B, T+1, V); logits past a row's own
        response (padding) are zeros, and masked out of every loss. On a GPU one padded pass; on a CPU the rows
        are packed into cheaper passes (`packed_response_logits`, which explains `passes`)."""
        T = batch["response_ids"].shape[1]
        # Sharded (FSDP), every rank must run the same forwards, whatever its rows: each gathers and reduces layers
        # (the packed passes depend on the lengths), and a decoder called alone (the prefix pass) bypasses the root
        # unit that gathers the embeddings.
        if batch["input_ids"].device.type != "cpu" or is_sharded(model):
            return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         position_ids=batch["position_ids"], logits_to_keep=T + 1, use_cache=False).logits
        return packed_response_logits(model, batch, passes)

    def _precision(self):
        """The autocast context the update runs in (Lightning enters it around `training_step`), for the
        passes made outside it: old log-probs scored in another precision would make the first ratio != 1."""
        if self._trainer is None:
            return contextlib.nullcontext()
        return self.trainer.precision_plugin.forward_context()

    @torch.no_grad()
    def ref_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Log-probs under the frozen reference policy, (B, T): a frozen copy, or for a LoRA policy the
        same weights with the adapters switched off (no second copy of the base in memory)."""
        if self.ref_policy is not None:
            return self.response_logprobs(batch, model=self.ref_policy)
        with self.policy.disable_adapter():
            return self.response_logprobs(batch)

    def logprob_gap(self, samples: list[StepSample], old: list[torch.Tensor]) -> dict[str, float]:
        """`rollout/logprob_gap_{mean,max,kl}`: the engine's log-probs against the scoring pass's old log-probs
        (`core_algos.logprob_gap`) over the samples that have both, those of every data-parallel rank (an
        all-reduce every rank must join); {} where none has (no engine log-probs recorded, or they
        were the old log-probs: the gap is then 0 by construction)."""
        pairs = [(o, torch.tensor(s.engine_logprobs, dtype=torch.float32)) for s, o in zip(samples, old)
                 if s.engine_logprobs is not None and s.behaviour_logprobs is None]
        totals = core_algos.logprob_gap_totals(torch.cat([o for o, _ in pairs]) if pairs else torch.zeros(0),
                                               torch.cat([e for _, e in pairs]) if pairs else torch.zeros(0))
        if self.trainer.world_size > 1:
            sums, biggest = totals[:3].to(self.device), totals[3:].to(self.device)
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)
            dist.all_reduce(biggest, op=dist.ReduceOp.MAX)
            totals = torch.cat([sums, biggest]).cpu()
        if totals[0] == 0:
            return {}
        return {f"rollout/logprob_gap_{k}": v for k, v in core_algos.logprob_gap_of_totals(totals).items()}

    def old_logprobs(self, samples: list[StepSample], micro_batch_size: int) -> list[torch.Tensor]:
        """Behaviour log-probs with the current weights, before any update of this iteration, (T_i,) float32
        per sample: those `generate` recorded (`StepSample.behaviour_logprobs`, only where they are exactly the
        distribution scored here), else scored by `score_behaviour`."""
        todo = [i for i, s in enumerate(samples) if s.behaviour_logprobs is None]
        scored = dict(zip(todo, self.score_behaviour([samples[i] for i in todo], micro_batch_size)))
        return [scored[i] if i in scored else torch.tensor(s.behaviour_logprobs, dtype=torch.float32)
                for i, s in enumerate(samples)]

    @torch.no_grad()
    def score_behaviour(self, samples: list[StepSample], micro_batch_size: int) -> list[torch.Tensor]:
        """The responses scored on their behaviour prompts by a forward pass, at the rollout temperature in the
        update's precision context.

        Sharded (FSDP), the pass runs on the shards, gathering one layer at a time as the update does, and every
        rank must call it: each forward gathers collectively, and ranks hold different numbers of samples, so
        every rank runs as many forwards as the busiest one, the others padding with one-token forwards."""
        was_training = self.policy.training
        self.policy.eval()
        rows: list[torch.Tensor] = []
        starts = range(0, len(samples), micro_batch_size)
        sharded = is_sharded(self.policy)
        forwards = self._busiest(len(starts)) if sharded else len(starts)
        with self._precision():
            for start in starts:
                mb = samples[start:start + micro_batch_size]
                batch = {k: v.to(self.device) for k, v in collate(mb, self.pad_id, prompt="behaviour").items()}
                lp = self.response_logprobs(batch).cpu()  # (b, T)
                rows += [lp[b, :len(s.response_ids)] for b, s in enumerate(mb)]
            for _ in range(forwards - len(starts)):
                self.policy(input_ids=torch.zeros((1, 1), dtype=torch.long, device=self.device), use_cache=False,
                            logits_to_keep=1)
        if sharded:
            reshard(self.policy)
        self.policy.train(was_training)
        return rows

    def _busiest(self, count: int) -> int:
        """The largest `count` of all ranks (an all-reduce every rank must join)."""
        t = torch.tensor([count], device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return int(t.item())

    # ------------------------------------------------------------------------------------- update
    def micro_batch_loss(self, micro: MicroBatch,
                         passes: list | None = None) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
        """The EMPO² loss of one micro-batch as its part of the mini-batch loss: every term is normalised by
        the whole mini-batch's valid tokens / responses (`MicroBatch`; under data parallelism the global
        mini-batch's), so the micro-batch losses, and their gradients, add up to the mini-batch's however it is
        split, over micro-batches and over ranks. Returns (loss, metrics, offpolicy (b,)).
        With `passes`, the loss's backward must be followed by `backward_passes(passes)`."""
        a = self.algo
        samples = [self.buffer.samples[i] for i in micro.indices]
        batch = {k: v.to(self.device) for k, v in collate(samples, self.pad_id, prompt="train").items()}
        mask = batch["response_mask"]  # (b, T)
        # learner prompt: tip-free for off-policy samples
        out = self.response_logprobs(batch, with_entropy=a.entropy_coef > 0, passes=passes)
        logp, entropy = out if a.entropy_coef > 0 else (out, None)  # (b, T) each
        old = pad_logprobs([self.buffer.old_logprobs[i] for i in micro.indices], mask.shape[1])
        old = old.to(self.device)  # (b, T), behaviour prompt, current weights before this iteration's updates
        adv = torch.tensor([s.advantage for s in samples], device=self.device)  # (b,)
        offpolicy = torch.tensor([s.offpolicy for s in samples], device=self.device)  # (b,)
        # off-policy tokens the tip-free (target) policy finds unlikely (p < delta) leave the loss; the released
        # code judges them on the behaviour log-probs instead (`algo.mask_logprobs`)
        judged = old if a.mask_logprobs == "behaviour" else logp.detach()
        loss_mask = core_algos.empo2_loss_mask(mask, judged, offpolicy, a.delta, a.mask_mode, a.mask_scope)
        norm = dict(response_mask=mask, num_tokens=micro.num_tokens, num_seqs=micro.num_seqs)
        weights = None if a.tis_cap is None else self.tis_weights(micro.indices, old, mask)  # (b, T)
        loss, metrics = core_algos.policy_loss(logp, old, adv, loss_mask, a.clip_low, a.clip_high, a.dual_clip_c,
                                               a.loss_agg, **norm, token_weights=weights)
        if weights is not None:
            valid = mask.sum().clamp(min=1)
            metrics["tis_weight_mean"] = float(torch.where(mask, weights, 0.0).sum() / valid)
            metrics["tis_truncated_frac"] = float((mask & (weights >= a.tis_cap)).sum() / valid)
        if a.kl_coef > 0:
            ref = self.ref_logprobs(batch)
            kl = core_algos.agg_loss(core_algos.kl_penalty(logp, ref, a.kl_kind), loss_mask, a.loss_agg, **norm)
            loss = loss + a.kl_coef * kl
            metrics["kl_ref"] = float(kl.detach())
        if entropy is not None:  # a bonus: maximising entropy lowers the loss (verl's sign)
            ent = core_algos.agg_loss(entropy, loss_mask, a.loss_agg, **norm)
            loss = loss - a.entropy_coef * ent
            metrics["entropy"] = float(ent.detach())
        metrics["loss"] = float(loss.detach())
        return loss, metrics, offpolicy

    def tis_weights(self, indices: list[int], old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Truncated importance sampling weights min(pi_old / pi_engine, algo.tis_cap) of a micro-batch, (b, T): 1 for
        a sample whose engine log-probs were not recorded or are its old log-probs (the exact mode)."""
        rows = []
        for b, i in enumerate(indices):
            s = self.buffer.samples[i]
            recorded = s.engine_logprobs is not None and s.behaviour_logprobs is None
            rows.append(torch.tensor(s.engine_logprobs, dtype=torch.float32) if recorded else old[b].cpu())
        engine = pad_logprobs(rows, mask.shape[1]).to(self.device)  # (b, T)
        return core_algos.truncated_is_weights(old, engine, mask, self.algo.tis_cap)

    def training_step(self, micro: MicroBatch, batch_idx: int):
        """One micro-batch of the EMPO² update; the optimiser steps after the last one of a mini-batch."""
        # pass by pass, except under DDP, whose reducer takes each parameter's gradient once per forward
        passes = [] if self._trainer is None or self.trainer.world_size == 1 else None
        loss, metrics, offpolicy = self.micro_batch_loss(micro, passes)
        if self.tcfg.release_memory:
            release_free_memory()
        # Backward even when the loss is not finite, and for zero-weight padding: under DDP every rank must
        # reduce, and a NaN then reaches every rank's gradient norm, so all ranks skip the same step.
        # DDP and FSDP2 average the ranks' gradients; each rank's loss is its part of the global mini-batch's
        # (normalised by the global counts), so scaling it by the number of ranks turns that average into the
        # sum of the parts: the gradient of the global mini-batch's loss, as verl scales by its dp size.
        self.manual_backward(loss * (micro.weight * self.trainer.world_size))
        self.backward_passes(passes)
        metrics["offpolicy_frac"] = float(offpolicy.float().sum()) / max(micro.num_seqs, 1)
        tokens = sum(len(self.buffer.samples[i].response_ids) for i in micro.indices)
        share = tokens / max(micro.num_tokens, 1)  # this micro-batch's share of the mini-batch's tokens
        for k, v in metrics.items():
            # loss, kl_ref, entropy and offpolicy_frac are already parts of the mini-batch's: they add up. Every
            # rank adds every key, padding a zero, since `_step` sums the ranks' totals key by key.
            part = (v if k in ("loss", "kl_ref", "entropy", "offpolicy_frac") else v * share) if micro.weight else 0.0
            self._totals[k] = self._totals.get(k, 0.0) + part
        if micro.last:
            self._step()
            maybe_fail("update", self.buffer.iteration)
        if micro.closes_iteration:
            self._log_iteration()

    @staticmethod
    def backward_passes(passes: list | None) -> None:
        """After the loss's backward has reached the leaves `packed_response_logits` put in place of each pass's
        outputs: each pass's own backward, last appended first, so its parameter gradients add into `.grad`."""
        while passes:
            outputs, leaves = passes.pop()
            reached = [(out, leaf.grad) for out, leaf in zip(outputs, leaves) if leaf.grad is not None]
            if reached:
                torch.autograd.backward(*zip(*reached))

    def _step(self) -> None:
        opt = self.optimizers()
        totals, self._totals = self._global(self._totals), {}
        grad_norm = self._clip_gradients()
        if not (math.isfinite(grad_norm) and math.isfinite(totals.get("loss", 0.0))):
            opt.zero_grad(set_to_none=True)
            self.skipped_steps += 1
            self.consecutive_skips += 1
            if self.consecutive_skips >= self.tcfg.max_nonfinite_steps:
                # Saved here, while every rank still takes part (all of them skip the same steps), for
                # post-mortem inspection; kept out of checkpoints/ so `resume=auto` restarts from the last
                # iteration that ended cleanly rather than from the middle of this one.
                path = Path(self.trainer.default_root_dir) / NONFINITE_CHECKPOINT
                self.trainer.save_checkpoint(path)
                raise NonFiniteLossError(
                    f"{self.consecutive_skips} consecutive updates had a non-finite loss or gradient "
                    f"(trainer.max_nonfinite_steps={self.tcfg.max_nonfinite_steps}); stopped, state saved to {path}")
            return
        self.consecutive_skips = 0
        self._set_lr(opt)
        opt.step()
        opt.zero_grad(set_to_none=True)
        self.last_step = {f"actor/{k}": float(v) for k, v in totals.items()}
        for k, v in {**self.last_step, "actor/grad_norm": grad_norm, "train/lr": opt.param_groups[0]["lr"]}.items():
            acc = self._iteration.setdefault(k, [0.0, 0])
            acc[0] += v
            acc[1] += 1

    def _global(self, totals: dict[str, float]) -> dict[str, float]:
        """The global mini-batch's metrics from every rank's parts of them (one all-reduce per optimiser step): each
        part is already weighted by the global counts, so the sum is the metric one process holding the whole
        mini-batch logs; every rank then judges the same loss finite or not."""
        if self.trainer.world_size == 1:
            return totals
        keys = sorted(totals)
        t = torch.tensor([totals[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return dict(zip(keys, t.tolist()))

    def _log_iteration(self) -> None:
        """One value per iteration, the mean over its optimiser steps (skipped ones excluded, each other
        weighing the same), and the skipped steps so far; logged at the iteration like every rollout and
        validation metric, so all curves share one x-axis."""
        metrics = {k: total / n for k, (total, n) in self._iteration.items()}
        self._iteration = {}
        metrics["train/skipped_steps"] = float(self.skipped_steps)
        self.log_dict(metrics, on_step=False, on_epoch=True, batch_size=1)

    def _clip_gradients(self) -> float:
        params = [p for p in self.policy.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, self.tcfg.grad_clip)
        # FSDP2: the norm of sharded gradients is a DTensor of per-rank partial sums; every rank gets the total
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)

    def _set_lr(self, opt) -> None:
        """Linear warm-up over optimiser steps, then constant or cosine over iterations. A function of the
        step and iteration counters only, so a resumed run gets the same learning rates."""
        t = self.tcfg
        factor = min(1.0, (self.global_step + 1) / t.warmup_steps) if t.warmup_steps else 1.0
        if t.lr_schedule == "cosine":
            factor *= 0.5 * (1 + math.cos(math.pi * self.current_epoch / max(t.iterations, 1)))
        for group in opt.param_groups:
            group["lr"] = t.lr * factor

    def configure_model(self) -> None:
        """Lightning's hook for sharding, run once the processes are up and before the optimiser is made (and before
        DDP wraps the module or a checkpoint is restored): under `trainer=fsdp` the strategy shards the policy, and the
        KL reference alike (each rank holds 1/N of it, not a whole copy); then, under every strategy, the trainable
        weights become float32 master weights (`float32_master_weights`; after sharding, so each rank upcasts only its
        shard). A checkpoint's weights and optimizer state, whatever their dtype, are then loaded into float32 (torch
        casts optimizer state to its parameter's dtype). The KL reference is converted alike: it then computes at the
        policy's precision (a bfloat16 copy would not, wherever the residual stream and norms run in the parameters'
        dtype: 32-true, or bf16-mixed on a CPU), so the KL starts at exactly 0, the upcast weights being identical."""
        if isinstance(self.trainer.strategy, FSDP2Strategy):
            self.trainer.strategy.shard(self.policy)
            if self.ref_policy is not None:
                self.trainer.strategy.shard(self.ref_policy, frozen=True)
        float32_master_weights(self.policy)
        if self.ref_policy is not None:
            float32_master_weights(self.ref_policy, frozen=True)

    def configure_optimizers(self):
        params = [p for p in self.policy.parameters() if p.requires_grad]
        return adamw(params, lr=self.tcfg.lr, weight_decay=self.tcfg.weight_decay)

    # ---------------------------------------------------------------------------- checkpoint state
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["empo2_module"] = {"skipped_steps": self.skipped_steps, "consecutive_skips": self.consecutive_skips}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint.get("empo2_module", {})
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.consecutive_skips = int(state.get("consecutive_skips", 0))

"""Data parallelism does not change the update: two gloo processes under `trainer=ddp` and `trainer=fsdp`, holding an
uneven split of one fixed set of samples, compute at every optimiser step the gradient one process computes on the
union of their mini-batches, for every loss aggregation, with the KL and entropy terms and the delta mask on, and log
that union's metrics. `fsdp_bf16` runs the paper preset's numerics (weights read in bfloat16, float32 master weights,
bfloat16 compute): its gradients are float32 and equal the float32 union's within bfloat16 rounding.

The ranks run a real Lightning fit each (the torchrun environment tells Lightning the processes exist), fed through
`RolloutDataModule.set_rollouts`, the path the rollout callback takes. Gradients are compared before the optimiser
step (`trainer.grad_clip` is too large to clip), at the weights the ranks held for that step: a weight after AdamW
would hide a wrong weighting (Adam's first step is nearly the gradient's sign).
"""

import copy
import dataclasses
from datetime import timedelta
from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from empo2.algo import core_algos
from empo2.config import load_config
from empo2.lit.data import MicroBatch, RolloutBuffer, RolloutDataModule
from empo2.lit.module import EMPO2Module
from empo2.lit.strategy import build_strategy
from empo2.models import load_policy
from empo2.rollout.types import StepSample
from tests.services import as_torchrun_rank, spawn_ranks

# rank 0: five long responses; rank 1: two short ones, 11x fewer tokens, and in mini-batches of 2 nothing in one of
# rank 0's three mini-batches (a zero-weight padding micro-batch instead)
RESPONSE_LENGTHS = ([9, 11, 8, 10, 6], [2, 2])
STRATEGIES = {"ddp": ["trainer=ddp"], "fsdp": ["trainer=fsdp", "trainer.precision=32-true"],
              # the paper preset's numerics: weights read in bfloat16, float32 master weights, bfloat16 compute
              "fsdp_bf16": ["trainer=fsdp", "trainer.precision=bf16-mixed", "model.dtype=bfloat16"]}
# the union's gradient is a float32 one; bfloat16 compute (8 bits of mantissa) leaves it within 2% of its norm
GRAD_RTOL = {"ddp": 1e-5, "fsdp": 1e-5, "fsdp_bf16": 2e-2}


def _samples(vocab: int) -> list[StepSample]:
    """Rank 0's samples, then rank 1's: prompts of different lengths, every other sample off-policy (its train
    prompt is the behaviour prompt without a tip span), advantages of both signs."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i, n in enumerate(RESPONSE_LENGTHS[0] + RESPONSE_LENGTHS[1]):
        prompt = torch.randint(3, vocab, (4 + 5 * i % 13,), generator=g).tolist()
        tips = torch.randint(3, vocab, (5,), generator=g).tolist()
        off = i % 2 == 1
        out.append(StepSample(behaviour_ids=tips + prompt if off else prompt, train_ids=prompt,
                              response_ids=torch.randint(3, vocab, (n,), generator=g).tolist(), memory=off,
                              offpolicy=off, group_id=0, traj_id=i, step=0, advantage=float(i % 3) - 1.0))
    return out


def _config(strategy: str, agg: str, delta: float):
    # In bfloat16 the KL (0 at the start) and entropy (of a near-uniform random model) terms' gradients are mostly
    # rounding, and a step whose samples all have advantage 0 has nothing else: compared there, the policy term alone.
    terms = ["algo.kl_coef=0", "algo.entropy_coef=0"] if strategy == "fsdp_bf16" else \
        ["algo.kl_coef=0.1", "algo.entropy_coef=0.01"]
    return load_config(["model=tiny", *STRATEGIES[strategy], "trainer.accelerator=cpu", f"algo.loss_agg={agg}",
                        *terms, f"algo.delta={delta}",
                        "trainer.grad_clip=1e9", "trainer.mini_batch_size=2", "trainer.micro_batch_size=1",
                        "trainer.lr=1e-2"])


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


class StepRecorder(L.Callback):
    """Per optimiser step: the weights it started from and its gradient (full tensors), the samples (numbered over
    both ranks) this rank contributed, and the actor metrics of the step."""

    def __init__(self, first: int):
        self.first, self.steps, self.indices = first, [], []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        named = list(pl_module.policy.named_parameters())
        self.steps.append({"weights": {n: _full(p) for n, p in named},
                           "grads": {n: _full(p.grad) for n, p in named if p.grad is not None}})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch.weight:
            self.indices += [self.first + i for i in batch.indices]
        if batch.last:  # after the step's `on_before_optimizer_step`
            self.steps[-1].update(indices=self.indices, metrics=dict(pl_module.last_step))
            self.indices = []


class FixedRollouts(L.Callback):
    """The rollout callback's path with fixed samples: each rank's own samples in, the step counts and normalisers
    agreed."""

    def __init__(self, datamodule: RolloutDataModule, samples: list, old: list[torch.Tensor], rank: int) -> None:
        self.datamodule, self.samples, self.old, self.rank = datamodule, samples, old, rank

    def produce_iteration(self, trainer: L.Trainer) -> None:
        self.datamodule.set_rollouts(self.samples, self.old, 0, self.rank, 2)


def _engine(old: list[torch.Tensor], i: int) -> list[float]:
    """Sample i's log-probs as an engine gave them: the old ones off by a sample-dependent amount."""
    return (old[i] - 0.01 * (i + 1) * torch.arange(len(old[i]))).tolist()


def _rank(rank: int, port: int, results, strategy: str, old: list[torch.Tensor], delta: float, out_dir: Path) -> None:
    """One of two ranks: a one-iteration fit per loss aggregation on this rank's share of the samples."""
    as_torchrun_rank(rank, port)
    torch.set_num_threads(1)
    first = 0 if rank == 0 else len(RESPONSE_LENGTHS[0])
    mine = range(first, first + len(RESPONSE_LENGTHS[rank]))
    out = {}
    for agg in core_algos.AGG_MODES:
        cfg = _config(strategy, agg, delta)
        policy, tok = load_policy(cfg.model)
        samples = _samples(policy.config.vocab_size)
        t = cfg.trainer
        datamodule = RolloutDataModule(t.ppo_epochs, t.mini_batch_size, t.micro_batch_size, seed=0)
        source = FixedRollouts(datamodule, [samples[i] for i in mine], [old[i] for i in mine], rank)
        module = EMPO2Module(policy.train(), tok, cfg.algo, cfg.trainer, datamodule.buffer,
                             ref_policy=copy.deepcopy(policy).eval().requires_grad_(False))
        recorder = StepRecorder(first)
        strategy_ = build_strategy(cfg, policy)
        if strategy_ == "ddp":  # Lightning's, with a short timeout: a rank waiting for a failed one fails soon
            strategy_ = DDPStrategy(timeout=timedelta(seconds=90))
        else:
            strategy_._timeout = timedelta(seconds=90)
        trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=2, strategy=strategy_,
                            precision=t.precision, logger=False, callbacks=[source, recorder],
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False)
        trainer.fit(module, datamodule=datamodule)
        if agg == core_algos.AGG_MODES[0]:  # the sampler/trainer gap each rank logs: that of the union's tokens
            out["gap"] = module.logprob_gap([dataclasses.replace(samples[i], engine_logprobs=_engine(old, i))
                                             for i in mine], [old[i] for i in mine])
        # both ranks hold the same weights and gradients: rank 0 sends them
        out[agg] = [s if rank == 0 else {"indices": s["indices"], "metrics": s["metrics"]} for s in recorder.steps]
    # a file, not the queue: a queued tensor is a handle into this process's memory, gone when it exits, and a
    # process cannot exit while its queued megabytes wait in the pipe for the parent, which joins before it reads
    torch.save(out, out_dir / f"rank{rank}.pt")
    results.put(rank)


@pytest.fixture(scope="module")
def fixed():
    """The samples, their old log-probs (the initial policy's, perturbed so that ratios move and clip) and a delta
    that masks about half of the off-policy tokens."""
    cfg = load_config(["model=tiny"])
    policy, tok = load_policy(cfg.model)
    samples = _samples(policy.config.vocab_size)
    module = EMPO2Module(policy, tok, cfg.algo, cfg.trainer, RolloutBuffer(samples))
    scored = module.old_logprobs(samples, 4)
    g = torch.Generator().manual_seed(1)
    old = [lp + 0.3 * torch.randn(len(lp), generator=g) for lp in scored]
    delta = float(torch.cat([lp for lp, s in zip(scored, samples) if s.offpolicy]).exp().median())
    return samples, old, delta, scored


def _union_step(strategy: str, agg: str, delta: float, samples, old, weights: dict, indices: list[int]):
    """One process holding the union of the ranks' mini-batches, at the given weights: its gradient and metrics."""
    cfg = _config(strategy, agg, delta)
    initial, tok = load_policy(cfg.model)
    initial = initial.float()  # a float32 process, from the weights as the ranks read them (and their KL reference)
    policy = copy.deepcopy(initial).train()
    with torch.no_grad():
        for name, p in policy.named_parameters():
            p.copy_(weights[name])
    module = EMPO2Module(policy, tok, cfg.algo, cfg.trainer, RolloutBuffer(samples, old),
                         ref_policy=initial.eval().requires_grad_(False))
    tokens = sum(len(samples[i].response_ids) for i in indices)
    loss, metrics, offpolicy = module.micro_batch_loss(MicroBatch(indices, tokens, len(indices), last=True))
    loss.backward()
    metrics["offpolicy_frac"] = float(offpolicy.float().mean())
    return {n: p.grad for n, p in policy.named_parameters() if p.grad is not None}, metrics


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_two_uneven_ranks_compute_the_gradient_and_metrics_of_their_union(strategy, fixed, tmp_path):
    samples, old, delta, scored = fixed
    bf16 = strategy == "fsdp_bf16"
    if bf16:
        # No delta mask (a token near delta may flip between bfloat16 and float32) and old log-probs the policy's
        # own, so no ratio starts clipped: the gradient is the policy term's, not a sum of near-zero ones whose
        # bfloat16 rounding would be all of it.
        old, delta = scored, 0.0
    tokens = [sum(lengths) for lengths in RESPONSE_LENGTHS]
    assert tokens[0] >= 3 * tokens[1]
    assert spawn_ranks(partial(_rank, strategy=strategy, old=old, delta=delta, out_dir=tmp_path), timeout=600) == [0, 1]
    steps0, steps1 = (torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in (0, 1))
    union = core_algos.logprob_gap(torch.cat(old), torch.cat([torch.tensor(_engine(old, i)) for i in range(len(old))]))
    assert steps0["gap"] == steps1["gap"]
    assert steps0["gap"] == {f"rollout/logprob_gap_{k}": pytest.approx(v, rel=1e-9) for k, v in union.items()}
    for agg in core_algos.AGG_MODES:
        assert len(steps0[agg]) == len(steps1[agg]) == 3  # mini-batches of 2 over rank 0's five samples
        assert [] in [s["indices"] for s in steps1[agg]]  # a step in which rank 1 has no sample
        masked = []
        for k, (a, b) in enumerate(zip(steps0[agg], steps1[agg])):
            grads, metrics = _union_step(strategy, agg, delta, samples, old, a["weights"],
                                         a["indices"] + b["indices"])
            assert a["grads"].keys() == grads.keys()
            # float32 master weights and gradients, whatever dtype the weights were read in
            assert {t.dtype for t in [*a["weights"].values(), *a["grads"].values()]} == {torch.float32}
            if bf16:  # the whole gradient: a key bias's is 0 in exact arithmetic, so bfloat16 rounding is all of it
                diff = torch.stack([(a["grads"][name] - g).norm() for name, g in grads.items()]).norm()
                assert diff <= GRAD_RTOL[strategy] * torch.stack([g.norm() for g in grads.values()]).norm(), (agg, k)
            for name, g in grads.items() if not bf16 else ():  # relative to each gradient's norm: entries near 0
                assert (a["grads"][name] - g).norm() <= GRAD_RTOL[strategy] * g.norm(), (agg, k, name)  # carry rounding
            assert a["metrics"] == b["metrics"]  # every rank logs the global mini-batch's numbers
            for key in ("loss", "masked_frac", "offpolicy_frac", *(() if bf16 else ("kl_ref", "entropy"))):
                # bfloat16: the loss sums +-A * ratio terms that cancel; each ratio carries a rounding of 2^-8, |A| <= 1
                assert a["metrics"][f"actor/{key}"] == pytest.approx(metrics[key], rel=GRAD_RTOL[strategy],
                                                                     abs=2**-8 if bf16 else 1e-7), (agg, k, key)
            masked.append(metrics["masked_frac"])
        assert max(masked) > 0 or bf16  # the delta mask is active
        moved = steps0[agg][-1]["weights"]
        assert any(not torch.equal(moved[n], w) for n, w in steps0[agg][0]["weights"].items())  # later steps too


CASES = {"an_empty_rank": (3, 0), "both_hold_samples": (3, 2)}  # samples on rank 0, rank 1


def _set_rollouts_rank(rank: int, port: int, results) -> None:
    """`set_rollouts` on this rank's share of each case: the mini-batches it will run, per case."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    dm = RolloutDataModule(ppo_epochs=1, mini_batch_size=2, micro_batch_size=1, seed=0)
    n_mini = {}
    for case, counts in CASES.items():
        samples = [StepSample(behaviour_ids=[1], train_ids=[1], response_ids=[2, 3], memory=False, offpolicy=False,
                              group_id=0, traj_id=i, step=0) for i in range(counts[rank])]
        n_mini[case] = dm.set_rollouts(samples, [torch.zeros(2)] * len(samples), 0, rank, 2)
    dist.destroy_process_group()
    results.put((rank, n_mini))


def test_a_rank_without_samples_skips_the_update_on_every_rank_instead_of_hanging(capfd):
    """A rank with no sample (all its steps dropped as overlong, say) cannot pad its mini-batches with one of its
    own samples: every rank agrees to skip the iteration's update (0 mini-batches) and says so once, where the rank
    once raised and left its peers waiting in the next collective."""
    expected = {"an_empty_rank": 0, "both_hold_samples": 2}
    # spawned: capfd reads what the ranks write
    assert spawn_ranks(_set_rollouts_rank, timeout=120, start="spawn") == [(0, expected), (1, expected)]
    said = capfd.readouterr().err.count("a rank has no sample to train on; the update is skipped on every rank")
    assert said == 1

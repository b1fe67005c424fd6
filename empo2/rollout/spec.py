"""`CollectionSpec`: what one call of `RolloutWorker.collect` plays, frozen, and built from the config per kind of
call. A call never inherits settings from an earlier one and nothing changes them between calls: training rollouts
(`training_spec`, beta on its schedule), scoring with or without tips (`scoring_spec`: validation and `empo2 eval`),
adaptation trials (`adaptation_spec`), and any other call from the config's values (`collection_spec`, with the
changes that call makes). `empo2.config` documents each value (`algo.*`, `rollout.*`, `memory.*`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from empo2.algo import core_algos
from empo2.config import TrainConfig
from empo2.rollout.build import generation_logprobs_exact, records_engine_logprobs, tip_block_tokens


@dataclass(frozen=True)
class CollectionSpec:
    # memory modes (prob. p, at the granularity) and, for memory samples, off-policy updates (prob. q)
    p: float = 0.25
    q: float = 0.68
    mode_granularity: str = "episode"
    # True: the call only scores the policy; it draws no update modes, counts no visits, writes no tips, drops no
    # step and rates episodes by their extrinsic return (`scoring_spec` sets the values that go with it)
    scoring: bool = False
    # returns and advantages
    beta: float = 0.0  # this call's weight of the intrinsic reward (the schedule is evaluated by `training_spec`)
    intrinsic: str = "novelty"  # r_int: "novelty" 1/n(s), or "retrieval" 1/(count+1) on memory-mode steps
    intrinsic_in_advantage: bool = True  # False: r_int is logged but the advantages read the extrinsic return
    normalize_std: bool = True
    adv_eps: float = 1e-6
    # sampling of actions
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 32
    # retrieval
    top_k: int = 10
    min_sim: float = 0.5
    # the most tokens an action prompt's tip block may take (`empo2.rollout.build.tip_block_tokens`: what vLLM's
    # default max_model_len allows for); a step keeps the leading retrieved tips whose block fits, None keeps all
    max_tip_block_tokens: int | None = None
    key_text: str = "state"  # memory key / query text: "state" (task + observation) or "history" (whole chat)
    tips_in_history: bool = False  # past turns keep the tip blocks their prompts carried (released code)
    # tip writing
    write_tips: bool = True
    # False: the call's new tips are only returned (`RolloutBatch.new_tips`) for the caller to add: all-gathered
    # under data parallelism, after the whole trial in adaptation
    add_tips: bool = True
    max_tip_words: int = 100
    tip_max_new_tokens: int = 160
    tip_temperature: float = 1.0
    per_step_entries: bool = False
    step_entry_key: str = "step"  # per-step entries keyed by their own step's state, or "final": the episode's last
    tip_format: str = "line"  # the tip as one sanitised line, or "raw": the policy's output as written (released code)
    # `rollout.overlong=drop`: a training step whose prompt + response exceeds this many tokens is no sample, and its
    # reward stays out of the return (released code); None keeps every step
    drop_over_tokens: int | None = None
    # training steps keep generate's log-probs (`StepSample.engine_logprobs`); `empo2.rollout.build` decides both
    record_logprobs: bool = False
    # ... and take them as their behaviour log-probs, in place of the scoring pass: only for an engine that samples
    # from the trainer's own weights in the trainer's float32 precision, whole vocabulary (needs record_logprobs)
    exact_logprobs: bool = False

    def for_scoring(self, mem: bool, temperature: float) -> CollectionSpec:
        """This collection as a scoring one: every rollout with tips (`mem`, where there is a memory) or none (nomem),
        sampled at `temperature`, nothing written, recorded or dropped."""
        return dataclasses.replace(self, scoring=True, p=1.0 if mem else 0.0, temperature=temperature,
                                   write_tips=False, drop_over_tokens=None, record_logprobs=False,
                                   exact_logprobs=False)


def collection_spec(cfg: TrainConfig, **changes) -> CollectionSpec:
    """The config's collection, beta at `algo.beta_start`, with a call's `changes` on top."""
    a, r, m = cfg.algo, cfg.rollout, cfg.memory
    values = dict(
        p=a.p, q=a.q, mode_granularity=a.mode_granularity, beta=a.beta_start, intrinsic=a.intrinsic,
        intrinsic_in_advantage=a.intrinsic_in_advantage, normalize_std=a.normalize_std, adv_eps=a.adv_eps,
        temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens, top_k=m.top_k, min_sim=m.min_sim,
        max_tip_block_tokens=tip_block_tokens(cfg), key_text=m.key_text, tips_in_history=r.tips_in_history,
        max_tip_words=m.max_tip_words, tip_max_new_tokens=r.tip_max_new_tokens, tip_temperature=r.tip_temperature,
        per_step_entries=m.per_step_entries, step_entry_key=m.step_entry_key, tip_format=m.tip_format,
        drop_over_tokens=r.max_prompt_tokens if r.overlong == "drop" else None,
        record_logprobs=records_engine_logprobs(cfg), exact_logprobs=generation_logprobs_exact(cfg))
    return CollectionSpec(**{**values, **changes})


def training_spec(cfg: TrainConfig, iteration: int, world_size: int = 1) -> CollectionSpec:
    """The rollouts of training iteration `iteration`: beta on its schedule, which ends on the last iteration that
    runs (iterations - 1), so that one uses beta_end; under data parallelism (`world_size` > 1) the new tips are
    all-gathered by the caller rather than added by each rank."""
    a = cfg.algo
    beta = core_algos.beta_at(iteration, cfg.trainer.iterations - 1, a.beta_start, a.beta_end, a.beta_schedule)
    return collection_spec(cfg, beta=beta, add_tips=world_size == 1)


def scoring_spec(cfg: TrainConfig, mem: bool) -> CollectionSpec:
    """Validation and evaluation: every rollout with tips or none, at `rollout.val_temperature`."""
    return collection_spec(cfg).for_scoring(mem, cfg.rollout.val_temperature)


def adaptation_spec(cfg: TrainConfig) -> CollectionSpec:
    """A trial of the memory-only adaptation (`empo2 adapt`): every prompt carries tips and nothing is trained
    (q = 0), at `rollout.val_temperature`; the trial's tips are added after it, so no episode sees its own trial's
    tips."""
    return collection_spec(cfg, p=1.0, q=0.0, temperature=cfg.rollout.val_temperature, add_tips=False)

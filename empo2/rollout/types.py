"""What a rollout produces: step samples (the unit of training), trajectories and the batch.

Each environment step is one training sample: the prompt is the chat so far and the response is the
action tokens. Every step of a trajectory gets that trajectory's group advantage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class StepSample:
    behaviour_ids: list[int]  # prompt the action was sampled from (carries the tip block in memory mode)
    train_ids: list[int]  # prompt the learner scores: tip-free for off-policy samples, else behaviour_ids
    response_ids: list[int]  # generated action tokens, stop token included
    memory: bool  # memory-augmented rollout step (tips in the behaviour prompt)
    offpolicy: bool  # updated off-policy: old log-probs on behaviour_ids, new ones on the tip-free train_ids
    group_id: int  # task instance: advantages are relative within a group
    traj_id: int
    step: int
    advantage: float = 0.0
    # log pi_T(response token) recorded by `generate` when it is exactly the distribution the trainer scores
    # (see `CollectionSpec.exact_logprobs`); None: the trainer scores the behaviour prompt itself
    behaviour_logprobs: list[float] | None = None
    # the engine's log-prob of each response token as it sampled it (`CollectionSpec.record_logprobs`), for the
    # sampler/trainer gap and truncated importance sampling; None: not recorded
    engine_logprobs: list[float] | None = None
    # both prompts' first prefix_len tokens are the system and task text (`Prompt.prefix_len`): the CPU update
    # runs them once for all rows of a micro-batch that share them; 0: no shared part
    prefix_len: int = 0


@dataclass
class Trajectory:
    task: str
    variation: int
    group_id: int
    traj_id: int
    samples: list[StepSample] = field(default_factory=list)
    ext_return: float = 0.0  # sum of extrinsic rewards (scaled score changes)
    intrinsic: list[float] = field(default_factory=list)  # r_int(s_t) = 1/n(s_t) per step
    ret: float = 0.0  # R = R_ext + beta * sum_t r_int, what the advantage is computed from
    score: float = 0.0
    won: bool = False
    invalid_actions: int = 0
    tips_used: set[int] = field(default_factory=set)  # memory ids that appeared in this trajectory's prompts
    # drawn in memory mode at some step it played: with no tip in any prompt it found nothing, and is not tip-free
    wanted_tips: bool = False
    env_error: str | None = None
    tip: str | None = None  # the tip the policy wrote after the episode (after sanitising), if any
    dropped_steps: int = 0  # steps left out of training as over-long (`rollout.overlong=drop`), rewards included

    @property
    def length(self) -> int:
        return len(self.samples)

    @property
    def carried_tips(self) -> bool:
        return any(smp.memory for smp in self.samples)


@dataclass
class RolloutBatch:
    samples: list[StepSample]
    trajectories: list[Trajectory]
    stats: dict[str, float]
    # memory entries written after these episodes: (texts, (n, dim) key vectors, metas); under data
    # parallelism they are all-gathered and merged so every rank holds the same memory
    new_tips: tuple[list[str], np.ndarray, list[dict]] | None = None

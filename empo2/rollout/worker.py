"""`RolloutWorker`: plays group rollouts with EMPO²'s memory modes, novelty bonus and self-written tips.

The worker owns what rollouts are played with: the generation engine, the prompt builder, the environments, the tip
memory (with its embedder) and the novelty counter, whose state it checkpoints (`state_dict`). What one call plays is
its `CollectionSpec` (`empo2.rollout.spec`), built from the config for each kind of call.

One call of `collect` plays B task instances x N environments (one group per instance) to the end, in lock-step:
every step does one batched retrieval for the memory-mode environments, one batched `generate` over all live
environments, then one `step` per environment. With an engine shared by several processes (tensor parallelism) the
steps go on while any of them has live environments, with an empty `generate` where this one has none.
When the episodes end the policy writes a tip for each of them in one batched call; the tips are
sanitised, embedded and added to memory. Returns are mixed with the intrinsic reward, turned into
group advantages and copied onto every step sample, all through `empo2.algo.core_algos`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from empo2.algo import core_algos
from empo2.algo.stats import memory_gain
from empo2.envs import TaskSpec, TextEnv
from empo2.memory import Embedder, TipMemory, episode_entries, sanitize_tip
from empo2.rollout.engines import GenerationEngine, SamplingParams
from empo2.rollout.novelty import NoveltyCounter
from empo2.rollout.prompts import PromptBuilder
from empo2.rollout.types import RolloutBatch, StepSample, Trajectory

if TYPE_CHECKING:  # annotations only: the spec module builds specs with `empo2.rollout.build`, which builds workers
    from empo2.rollout.spec import CollectionSpec


def released_chat_text(task: str, history: list[tuple[str, str]], observation: str) -> str:
    """The released chat as its memory keys read it (`gather_chats` of microsoft/agent-lightning 0b40cb72,
    contrib/agentlightning/contrib/agent/empo2_agent.py:46-59, over the tip-free chat): "role: content" per message,
    joined by spaces, the task text after the first observation."""
    observations = [o for o, _ in history] + [observation]
    observations[0] += "\n" + task
    parts = [f"user: {o}" + (f" assistant: {a}" if t < len(history) else "")
             for t, (o, a) in enumerate(zip(observations, [a for _, a in history] + [""]))]
    return " ".join(parts)


def draw_seed(generator: torch.Generator) -> int:
    """The seed of one `generate` call, drawn from the call's generator."""
    return int(torch.randint(0, 2**31 - 1, (1,), generator=generator))


@dataclass
class Episodes:
    """The episodes of one `collect` call while they are played: trajectories, their environments, chats so far
    and modes, and where the call's time goes."""

    trajs: list[Trajectory]
    envs: list[TextEnv]
    memory_mode: torch.Tensor  # (R, S) bool: the rollout's prompt at step t carries tips
    offpolicy_mode: torch.Tensor  # (R, S) bool: ... and a memory sample there is updated off-policy
    obs: list[str] = field(default_factory=list)
    histories: list[list[tuple[str, str]]] = field(default_factory=list)
    turn_tips: list[list[list[str] | None]] = field(default_factory=list)  # the tips each past turn's prompt carried
    live: list[int] = field(default_factory=list)
    tokens_generated: int = 0
    timing: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("generate", "env", "memory", "tips"), 0.0))


class RolloutWorker:
    def __init__(self, engine: GenerationEngine | None, builder: PromptBuilder, envs: list[TextEnv],
                 memory: TipMemory | None, embedder: Embedder | None, max_episode_steps: int,
                 special_tokens: list[str] | None = None, rank: int = 0, novelty: NoveltyCounter | None = None) -> None:
        """`engine` None: `attach_engine` gives it one before the first `collect`. `max_episode_steps` bounds the
        lock-step loop and is the width of the mode draws (`empo2.rollout.build.episode_step_bound`): the
        environments end their episodes themselves."""
        self.engine, self.builder, self.envs = engine, builder, envs
        self.memory, self.embedder = memory, embedder
        self.max_episode_steps = max_episode_steps
        self.special_tokens = list(special_tokens or [])
        self.rank = rank
        self.novelty = novelty if novelty is not None else NoveltyCounter()

    @property
    def has_memory(self) -> bool:
        return self.memory is not None and self.embedder is not None

    def attach_engine(self, engine: GenerationEngine, rank: int) -> None:
        """The engine training builds once the strategy has opened the process group, and this process's rank
        (recorded with the tips it writes)."""
        self.engine, self.rank = engine, rank

    def using(self, *, envs: list[TextEnv] | None = None, memory: TipMemory | None = None,
              engine: GenerationEngine | None = None) -> RolloutWorker:
        """A worker over other environments, memory or engine that shares everything else with this one, its
        novelty counter included."""
        return RolloutWorker(self.engine if engine is None else engine, self.builder,
                             self.envs if envs is None else envs, self.memory if memory is None else memory,
                             self.embedder, self.max_episode_steps, self.special_tokens, self.rank, self.novelty)

    # -------------------------------------------------------------------------------------- Algorithm 1
    def collect(self, spec: CollectionSpec, tasks: list[TaskSpec], group_size: int, iteration: int,
                generator: torch.Generator, on_step: Callable[[int, int], None] | None = None) -> RolloutBatch:
        """Play `group_size` rollouts of every task instance as `spec` says (the paper's Algorithm 1, one batch):
        draw the memory and update modes; step every live environment, with tips retrieved for the memory-mode
        ones; let the policy write a tip per episode into memory; mix the returns with the intrinsic reward into
        group advantages. `on_step(finished, episodes)` hears after every lock-step how many of the episodes have
        ended (the progress bar's count). Every draw comes from `generator`: the modes first, then one seed per
        generate call."""
        t_start = time.perf_counter()
        play = self._start(spec, tasks, group_size, generator)  # memory modes (prob. p), off-policy (prob. q)
        params = SamplingParams(temperature=spec.temperature, top_p=spec.top_p, max_new_tokens=spec.max_new_tokens,
                                logprobs=spec.record_logprobs)
        for t in range(self.max_episode_steps):
            if not self.engine.group_has_work(bool(play.live)):  # a rank whose episodes ended still joins the calls
                break
            tips = self._retrieve(spec, play, t)  # Retr(s_t; M) for the rollouts in memory mode
            self._act(spec, play, t, tips, params, generator)  # a_t ~ pi(. | prompt), env.step, counts of n(s)
            if on_step is not None:
                on_step(len(play.trajs) - len(play.live), len(play.trajs))
        new_tips, tips_added = self._write_tips(spec, play, iteration, generator)  # tip ~ pi(. | episode) into M
        self._assign_advantages(spec, play)  # R = R_ext + beta * sum_t r_int, group advantages
        self._credit_tips(spec, play)
        samples = [smp for traj in play.trajs for smp in traj.samples]
        stats = self._stats(play, samples, tips_added, time.perf_counter() - t_start)
        return RolloutBatch(samples=samples, trajectories=play.trajs, stats=stats, new_tips=new_tips)

    def _start(self, spec: CollectionSpec, tasks: list[TaskSpec], group_size: int,
               generator: torch.Generator) -> Episodes:
        """Which rollouts (and steps) carry tips, and which of those are updated off-policy; then every episode
        reset to its task instance (a group of `group_size` per instance)."""
        n_traj = len(tasks) * group_size
        if n_traj > len(self.envs):
            raise ValueError(f"{n_traj} rollouts need {n_traj} environments, the worker has {len(self.envs)}")
        p = spec.p if self.has_memory else 0.0
        memory_mode = core_algos.draw_memory_modes(n_traj, self.max_episode_steps, p, spec.mode_granularity,
                                                   generator)  # (R, S) bool
        offpolicy_mode = (torch.zeros_like(memory_mode) if spec.scoring else
                          core_algos.draw_update_modes(memory_mode, spec.q, spec.mode_granularity, generator))
        trajs = [Trajectory(task=t.task, variation=t.variation, group_id=g, traj_id=g * group_size + j)
                 for g, t in enumerate(tasks) for j in range(group_size)]
        play = Episodes(trajs, self.envs[:n_traj], memory_mode, offpolicy_mode,
                        histories=[[] for _ in trajs], turn_tips=[[] for _ in trajs], live=list(range(n_traj)))
        t0 = time.perf_counter()
        for env, traj in zip(play.envs, trajs):
            o, _ = env.reset(task=traj.task, variation=traj.variation)
            play.obs.append(o)
        play.timing["env"] += time.perf_counter() - t0
        return play

    def _retrieve(self, spec: CollectionSpec, play: Episodes, t: int) -> dict[int, list[tuple[int, str]]]:
        """Retr(state; M): one batched embedding and search for the rollouts in memory mode at step `t`; (memory
        id, text) of the tips each finds. A rollout whose namespace holds no tip yet has nothing to find: no
        embedding is spent on it. Only the leading tips whose block fits `spec.max_tip_block_tokens` are kept (tips
        written longer than their budget, re-encoded, could otherwise take a request past vLLM's max_model_len)."""
        tips: dict[int, list[tuple[int, str]]] = {}
        trajs = play.trajs
        slots = {i: self.memory.namespace_key(trajs[i].task, trajs[i].variation)
                 for i in play.live if play.memory_mode[i, t]}
        mem_live = [i for i, slot in slots.items() if self.memory.size(slot)]
        if mem_live:
            t0 = time.perf_counter()
            queries = self.embedder.encode([self.retrieval_key(spec, play.envs[i], play.histories[i], play.obs[i])
                                            for i in mem_live])
            hits = self.memory.search(queries, [slots[i] for i in mem_live], k=spec.top_k, min_sim=spec.min_sim)
            for i, found in zip(mem_live, hits):
                texts = [rec.text for rec, _ in found]
                kept = self.builder.tips_that_fit(texts, spec.max_tip_block_tokens)
                tips[i] = [(rec.id, rec.text) for rec, _ in found[:kept]]
            play.timing["memory"] += time.perf_counter() - t0
        return tips

    def _act(self, spec: CollectionSpec, play: Episodes, t: int, tips: dict[int, list[tuple[int, str]]],
             params: SamplingParams, generator: torch.Generator) -> None:
        """One lock-step step: one batched generate over every live environment (prompts with the retrieved tips),
        one env.step each, each step recorded as a sample; then the intrinsic reward's counts of the step."""
        live, envs = play.live, play.envs
        step_tips = {i: [text for _, text in tips.get(i, [])] or None for i in live}
        prompts = [self.builder.build(envs[i].task_description, play.histories[i], play.obs[i], step_tips[i],
                                      play.turn_tips[i] if spec.tips_in_history else None) for i in live]
        t0 = time.perf_counter()
        # no draw without prompts: a rank's samples never depend on how long the rest of its group plays
        seed = draw_seed(generator) if live else None
        gens = self.engine.generate([pr.ids for pr in prompts], params, seed=seed)
        play.timing["generate"] += time.perf_counter() - t0

        t0 = time.perf_counter()
        still_live = []
        for i, prompt, gen in zip(live, prompts, gens):
            if not self._step_env(spec, play, i, t, prompt, gen, tips.get(i, []), step_tips[i]):
                still_live.append(i)
        if not spec.scoring and spec.intrinsic == "retrieval":  # tips retrieved per step; 1/(count+1) taken later
            for i in live:
                play.trajs[i].intrinsic.append(len(tips.get(i, [])))
        elif not spec.scoring:  # visit counts n(s) of the states this step led to; 1/n(s) is taken later
            for i, n in zip(live, self.novelty.visit_step([envs[i].state_key() for i in live])):
                play.trajs[i].intrinsic.append(n)
        play.live = still_live
        play.timing["env"] += time.perf_counter() - t0

    def _step_env(self, spec: CollectionSpec, play: Episodes, i: int, t: int, prompt, gen,
                  tips: list[tuple[int, str]], step_tips: list[str] | None) -> bool:
        """Rollout `i` takes its action: the step's sample (off-policy samples train on the tip-free prompt; an
        over-long one under `drop_over_tokens` is no sample), the env's reward and outcome. True when its episode
        ended."""
        traj = play.trajs[i]
        play.tokens_generated += len(gen.token_ids)
        offpolicy = bool(play.offpolicy_mode[i, t]) and prompt.has_tips
        dropped = spec.drop_over_tokens is not None and len(prompt.ids) + len(gen.token_ids) > spec.drop_over_tokens
        traj.dropped_steps += dropped
        if not dropped:
            traj.samples.append(StepSample(
                behaviour_ids=prompt.ids, train_ids=prompt.without_tips() if offpolicy else prompt.ids,
                response_ids=gen.token_ids, memory=prompt.has_tips, offpolicy=offpolicy, group_id=traj.group_id,
                traj_id=traj.traj_id, step=t, engine_logprobs=gen.logprobs,
                behaviour_logprobs=gen.logprobs if spec.exact_logprobs else None, prefix_len=prompt.prefix_len))
        traj.tips_used.update(tip_id for tip_id, _ in tips)
        traj.wanted_tips |= bool(play.memory_mode[i, t])
        res = play.envs[i].step(gen.text)
        traj.ext_return += 0.0 if dropped else res.reward
        traj.score, traj.won = float(res.info.get("score", 0.0)), bool(res.info.get("won", False))
        traj.invalid_actions += int(bool(res.info.get("invalid_action", False)))
        if res.info.get("env_error"):
            traj.env_error = str(res.info["env_error"])
        # the released chat shows the raw output as the past action (its `record_original_action`)
        raw_action = self.builder.template == "released"
        play.histories[i].append((play.obs[i], gen.text if raw_action else res.info.get("parsed_action") or gen.text))
        play.turn_tips[i].append(step_tips)
        play.obs[i] = res.obs
        return res.done

    # ------------------------------------------------------------------------------------------ tips
    def retrieval_key(self, spec: CollectionSpec, env: TextEnv, history: list[tuple[str, str]],
                      observation: str) -> str:
        """What retrieval compares (`key_text`): the task and the current observation, or the whole chat so
        far (the released code embeds the step's chat-history text)."""
        if spec.key_text == "history" and self.builder.template == "released":
            return released_chat_text(env.task_description, history, observation)
        if spec.key_text == "history":
            turns = "".join(f"{o}\n> {a}\n" for o, a in history)
            return f"{env.task_description}\n{turns}{observation}"
        return f"{env.task_description}\n{observation}"

    def _write_tips(self, spec: CollectionSpec, play: Episodes, iteration: int, generator: torch.Generator):
        """The policy writes one tip per finished episode (where the call writes tips and there is a memory), added
        to memory unless the caller adds them (`spec.add_tips`). Returns the entries written, (texts, keys, metas)
        or None, and how many were added."""
        if spec.scoring or not spec.write_tips or not self.has_memory:
            return None, 0
        new_tips = self._tip_entries(spec, play, iteration, generator)
        t0 = time.perf_counter()
        tips_added = len(self.memory.add(*new_tips)) if spec.add_tips and new_tips[0] else 0
        play.timing["memory"] += time.perf_counter() - t0
        return new_tips, tips_added

    def _tip_entries(self, spec: CollectionSpec, play: Episodes, iteration: int, generator: torch.Generator):
        """One batched call writes the tips, from each whole episode chat (with the tips its turns carried under
        `tips_in_history`); tips are sanitised (a tip can never open a chat turn) and keyed by the embedding of the
        episode's final state (per-step entries: of their own step's state, or all of the final one with
        `step_entry_key="final"`). Returns the memory entries (texts, keys, metas)."""
        envs, histories = play.envs, play.histories
        requests = [self.builder.build_tip_request(envs[i].task_description, histories[i], play.obs[i],
                                                   spec.max_tip_words,
                                                   play.turn_tips[i] if spec.tips_in_history else None)
                    for i in range(len(play.trajs))]
        params = SamplingParams(temperature=spec.tip_temperature, top_p=1.0, max_new_tokens=spec.tip_max_new_tokens,
                                stop_at_newline=False, kind="tip")
        t0 = time.perf_counter()
        gens = self.engine.generate(requests, params, seed=draw_seed(generator))
        play.timing["tips"] += time.perf_counter() - t0  # tip generation; sanitising and embedding count as memory
        t0 = time.perf_counter()
        texts, keys, metas = [], [], []
        for i, (traj, gen) in enumerate(zip(play.trajs, gens)):
            raw = spec.tip_format == "raw"
            tip = gen.text if raw else sanitize_tip(gen.text, spec.max_tip_words, self.special_tokens)
            if tip == "" and not spec.per_step_entries:  # a raw empty output: nothing to store (a step entry never is)
                tip = None
            traj.tip = tip
            if tip is None:
                continue
            meta = {"task": traj.task, "variation": traj.variation, "episode_return": traj.ext_return,
                    "iteration": iteration, "source_rank": self.rank}
            actions = [a for _, a in histories[i]]
            entry_texts, entry_metas = episode_entries(tip, meta, spec.per_step_entries, actions, traj.score,
                                                       released=raw)
            if spec.per_step_entries and spec.step_entry_key == "step":  # the state each step acted in
                keys += [self.retrieval_key(spec, envs[i], histories[i][:m["step"]], histories[i][m["step"]][0])
                         for m in entry_metas]
            else:
                keys += [self.retrieval_key(spec, envs[i], histories[i], play.obs[i])] * len(entry_texts)
            texts += entry_texts
            metas += entry_metas
        vectors = self.embedder.encode(keys) if keys else np.zeros((0, self.memory.dim), dtype=np.float32)
        play.timing["memory"] += time.perf_counter() - t0
        return texts, vectors, metas

    def _credit_tips(self, spec: CollectionSpec, play: Episodes) -> None:
        """Each tip a training episode's prompts carried takes that episode's extrinsic return into its utility."""
        if not self.has_memory or spec.scoring:
            return
        for traj in play.trajs:
            if traj.tips_used:
                self.memory.update_utility(sorted(traj.tips_used), traj.ext_return)

    # ------------------------------------------------------------------------------------ returns
    def _assign_advantages(self, spec: CollectionSpec, play: Episodes) -> None:
        """R_i = R_ext_i + beta * sum_t r_int (the extrinsic return alone when scoring, or where the intrinsic
        reward stays out of the advantage), group advantages, copied onto every step of the trajectory."""
        trajs = play.trajs
        ext = torch.tensor([tr.ext_return for tr in trajs], dtype=torch.float64)  # (R,)
        if spec.scoring:
            rets = ext
        else:
            counts = [torch.tensor(tr.intrinsic, dtype=torch.float64) for tr in trajs]
            if spec.intrinsic == "retrieval":  # r_int = 1/(retrieved + 1) on memory-mode steps, 0 elsewhere
                bonuses = [core_algos.retrieval_bonus(c, play.memory_mode[i, :len(c)]) for i, c in enumerate(counts)]
            else:
                bonuses = [core_algos.count_bonus(c) if len(c) else c for c in counts]  # r_int(s) = 1/n(s)
            for tr, b in zip(trajs, bonuses):
                tr.intrinsic = b.tolist()
            intrinsic_sums = torch.stack([b.sum() for b in bonuses])  # (R,)
            # the released code's bonus lands in token_level_rewards, which its advantage never reads
            rets = core_algos.mix_returns(ext, intrinsic_sums, spec.beta) if spec.intrinsic_in_advantage else ext
        group_ids = torch.tensor([tr.group_id for tr in trajs], dtype=torch.long)
        adv = core_algos.group_advantages(rets, group_ids, spec.normalize_std, spec.adv_eps)  # (R,)
        for tr, r, a in zip(trajs, rets.tolist(), adv.tolist()):
            tr.ret = r
            for smp in tr.samples:
                smp.advantage = a

    def _stats(self, play: Episodes, samples: list[StepSample], tips_added: int, wall: float) -> dict[str, float]:
        trajs = play.trajs
        n_t, n_s = max(len(trajs), 1), max(len(samples), 1)
        intrinsic = [x for tr in trajs for x in tr.intrinsic]
        stats = {
            "rollout/return": sum(tr.ret for tr in trajs) / n_t,
            "rollout/ext_return": sum(tr.ext_return for tr in trajs) / n_t,
            # beta * sum_t r_int: next to ext_return it shows which of the two the advantages follow
            "rollout/intrinsic_return": sum(tr.ret - tr.ext_return for tr in trajs) / n_t,
            "rollout/score": sum(tr.score for tr in trajs) / n_t,
            "rollout/success": sum(tr.won for tr in trajs) / n_t,
            "rollout/episode_len": len(samples) / n_t,
            "rollout/invalid_action_frac": sum(tr.invalid_actions for tr in trajs) / n_s,
            "rollout/memory_frac": sum(smp.memory for smp in samples) / n_s,
            "rollout/offpolicy_frac": sum(smp.offpolicy for smp in samples) / n_s,
            "rollout/env_errors": float(sum(tr.env_error is not None for tr in trajs)),
            "rollout/dropped_overlong": float(sum(tr.dropped_steps for tr in trajs)),
            "rollout/tokens_generated": float(play.tokens_generated),
            "intrinsic/mean_reward": float(np.mean(intrinsic)) if intrinsic else 0.0,
            "intrinsic/states_seen": float(len(self.novelty)),
            "memory/tips_added": float(tips_added),
            "memory/size": float(len(self.memory)) if self.memory is not None else 0.0,
            "time/rollout_s": wall,
        }
        # Per rollout kind: with tips (`mem`), drawn tip-free (`nomem`, as validation names it), and drawn in memory
        # mode but finding no tip (`mem_miss`, mostly an instance's first draw: never counted as tip-free). The
        # pooled scores describe; what the tips add is `memory_gain`, like for like within groups
        # (`empo2.algo.stats.memory_gain`), on the score.
        kinds = {"mem": [tr for tr in trajs if tr.carried_tips],
                 "nomem": [tr for tr in trajs if not tr.wanted_tips],
                 "mem_miss": [tr for tr in trajs if tr.wanted_tips and not tr.carried_tips]}
        for name, group in kinds.items():
            stats[f"rollout/episodes_{name}"] = float(len(group))
            if group:
                stats[f"rollout/score_{name}"] = sum(tr.score for tr in group) / len(group)
        gain, groups = memory_gain([tr.score for tr in trajs], [tr.group_id for tr in trajs],
                                   [tr.carried_tips for tr in trajs], [tr.wanted_tips for tr in trajs])
        stats["rollout/memory_gain_groups"] = float(groups)
        if groups:
            stats["rollout/memory_gain"] = gain
        stats.update({f"time/{k}_s": v for k, v in play.timing.items()})
        return stats

    # -------------------------------------------------------------------------------- checkpoint state
    def state_dict(self) -> dict:
        """The novelty counts and the tip memory (numpy arrays as tensors, so a checkpoint loads with
        `torch.load(weights_only=True)`)."""
        return {"novelty": self.novelty.state_dict(),
                "memory": _to_torch(self.memory.state_dict()) if self.memory is not None else None}

    def load_state_dict(self, state: dict) -> None:
        self.novelty.load_state_dict(state["novelty"])
        if state.get("memory") is not None and self.memory is not None:
            self.memory.load_state_dict(_to_numpy(state["memory"]))


def _to_torch(obj):
    """numpy arrays -> tensors, so checkpoints load with torch.load(weights_only=True)."""
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(obj))
    if isinstance(obj, dict):
        return {k: _to_torch(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_torch(v) for v in obj)
    return obj


def _to_numpy(obj):
    if isinstance(obj, torch.Tensor):
        return obj.numpy()
    if isinstance(obj, dict):
        return {k: _to_numpy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_numpy(v) for v in obj)
    return obj

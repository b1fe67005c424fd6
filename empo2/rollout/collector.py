"""Group rollouts with EMPO²'s memory modes, novelty bonus and self-written tips.

One call of `RolloutCollector.collect` plays B task instances x N environments (one group per
instance) to the end, in lock-step: every step does one batched retrieval for the memory-mode
environments, one batched `generate` over all live environments, then one `step` per environment. With an
engine shared by several processes (tensor parallelism) the steps go on while any of them has live
environments, with an empty `generate` where this one has none.
When the episodes end the policy writes a tip for each of them in one batched call; the tips are
sanitised, embedded and added to memory. Returns are mixed with the intrinsic reward, turned into
group advantages and copied onto every step sample, all through `empo2.algo.core_algos`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from empo2.algo import core_algos
from empo2.algo.stats import memory_gain
from empo2.envs import TaskSpec, TextEnv
from empo2.memory import Embedder, TipMemory, episode_entries, sanitize_tip
from empo2.rollout.engines import GenerationEngine, SamplingParams
from empo2.rollout.prompts import PromptBuilder
from empo2.rollout.types import RolloutBatch, StepSample, Trajectory


def released_chat_text(task: str, history: list[tuple[str, str]], observation: str) -> str:
    """The released chat as its memory keys read it (`gather_chats` of microsoft/agent-lightning 0b40cb72,
    contrib/agentlightning/contrib/agent/empo2_agent.py:46-59, over the tip-free chat): "role: content" per message,
    joined by spaces, the task text after the first observation."""
    observations = [o for o, _ in history] + [observation]
    observations[0] += "\n" + task
    parts = [f"user: {o}" + (f" assistant: {a}" if t < len(history) else "")
             for t, (o, a) in enumerate(zip(observations, [a for _, a in history] + [""]))]
    return " ".join(parts)


class NoveltyCounter:
    """Visit counts n(s) keyed by `env.state_key()`; they persist across iterations (and checkpoints),
    so a state stays familiar once the agent has seen it, which is what makes 1/n(s) an exploration
    bonus rather than per-episode noise."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def visit_step(self, keys: list[str]) -> list[int]:
        """Count every visit of one lock-step step, then read n(s) for each: rollouts that reach the same
        state at the same step get the same count, so the bonus is a function of the batch, never of the
        order the environments are stepped in (counting one environment at a time would pay the
        lowest-indexed rollout more, and std-normalised advantages would blow that up into a signal
        that encodes the rollout index)."""
        for key in keys:
            self.counts[key] = self.counts.get(key, 0) + 1
        return [self.counts[key] for key in keys]

    def __len__(self) -> int:
        return len(self.counts)

    def state_dict(self) -> dict:
        return {"counts": dict(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        self.counts = {str(k): int(v) for k, v in state["counts"].items()}


@dataclass
class CollectorSettings:
    """The knobs of one collection; `empo2.config` documents each (`algo.*`, `rollout.*`, `memory.*`)."""

    p: float = 0.25
    q: float = 0.68
    mode_granularity: str = "episode"
    beta: float = 0.0  # the value for this iteration (the schedule is evaluated by the caller)
    intrinsic: str = "novelty"  # r_int: "novelty" 1/n(s), or "retrieval" 1/(count+1) on memory-mode steps
    intrinsic_in_advantage: bool = True  # False: r_int is logged but the advantages read the extrinsic return
    normalize_std: bool = True
    adv_eps: float = 1e-6
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 32
    max_episode_steps: int = 100  # upper bound for the mode draws; environments end episodes themselves
    top_k: int = 10
    min_sim: float = 0.5
    max_tip_words: int = 100
    tip_max_new_tokens: int = 160
    tip_temperature: float = 1.0
    per_step_entries: bool = False
    step_entry_key: str = "step"  # per-step entries keyed by their own step's state, or "final": the episode's last
    tip_format: str = "line"  # the tip as one sanitised line, or "raw": the policy's output as written (released code)
    key_text: str = "state"  # memory key / query text: "state" (task + observation) or "history" (whole chat)
    tips_in_history: bool = False  # past turns keep the tip blocks their prompts carried (released code)
    write_tips: bool = True
    # `rollout.overlong=drop`: a training step whose prompt + response exceeds this many tokens is no sample, and its
    # reward stays out of the return (released code); None keeps every step
    drop_over_tokens: int | None = None
    # training steps keep generate's log-probs (`StepSample.engine_logprobs`); `empo2.rollout.build` decides both
    record_logprobs: bool = False
    # ... and take them as their behaviour log-probs, in place of the scoring pass: only for an engine that samples
    # from the trainer's own weights in the trainer's float32 precision, whole vocabulary (needs record_logprobs)
    exact_logprobs: bool = False


class RolloutCollector:
    def __init__(self, engine: GenerationEngine | None, builder: PromptBuilder, envs: list[TextEnv],
                 memory: TipMemory | None, embedder: Embedder | None, settings: CollectorSettings,
                 special_tokens: list[str] | None = None, rank: int = 0) -> None:
        self.engine, self.builder, self.envs = engine, builder, envs  # engine None: set by the owner before collect
        self.memory, self.embedder, self.settings = memory, embedder, settings
        self.special_tokens = list(special_tokens or [])
        self.rank = rank
        self.novelty = NoveltyCounter()
        # False under data parallelism: the caller all-gathers `RolloutBatch.new_tips` and merges them
        self.add_tips = True

    def collect(self, tasks: list[TaskSpec], group_size: int, iteration: int, generator: torch.Generator,
                evaluate: bool = False, use_memory: bool | None = None,
                on_step: Callable[[int, int], None] | None = None) -> RolloutBatch:
        """Play `group_size` rollouts of every task instance. `evaluate=True` samples at the given
        temperature with memory on (`use_memory=True`) or off, writes no tips, counts no visits and
        draws no update modes. `on_step(finished, episodes)` hears after every lock-step how many of the
        episodes have ended (the progress bar's count)."""
        s = self.settings
        n_traj = len(tasks) * group_size
        if n_traj > len(self.envs):
            raise ValueError(f"{n_traj} rollouts need {n_traj} environments, the collector has {len(self.envs)}")
        timing = dict.fromkeys(("generate", "env", "memory", "tips"), 0.0)
        t_start = time.perf_counter()

        # Which rollouts (and steps) carry tips, and which of those are updated off-policy.
        has_memory = self.memory is not None and self.embedder is not None
        if evaluate:
            p = 1.0 if (use_memory and has_memory) else 0.0
        else:
            p = s.p if has_memory else 0.0
        memory_mode = core_algos.draw_memory_modes(n_traj, s.max_episode_steps, p, s.mode_granularity,
                                                   generator)  # (R, S) bool
        offpolicy_mode = (torch.zeros_like(memory_mode) if evaluate else
                          core_algos.draw_update_modes(memory_mode, s.q, s.mode_granularity, generator))  # (R, S)

        trajs = [Trajectory(task=t.task, variation=t.variation, group_id=g, traj_id=g * group_size + j)
                 for g, t in enumerate(tasks) for j in range(group_size)]
        envs = self.envs[:n_traj]
        obs: list[str] = []
        histories: list[list[tuple[str, str]]] = [[] for _ in trajs]
        turn_tips: list[list[list[str] | None]] = [[] for _ in trajs]  # the tips each past turn's prompt carried
        t0 = time.perf_counter()
        for env, traj in zip(envs, trajs):
            o, _ = env.reset(task=traj.task, variation=traj.variation)
            obs.append(o)
        timing["env"] += time.perf_counter() - t0
        live = list(range(n_traj))
        params = SamplingParams(temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens,
                                logprobs=s.record_logprobs and not evaluate)
        tokens_generated = 0

        for t in range(s.max_episode_steps):
            if not self.engine.group_has_work(bool(live)):  # a rank whose episodes ended still joins the group's calls
                break
            # -- retrieval: one batched embedding + search for the memory-mode rollouts at this step
            tips: dict[int, list[tuple[int, str]]] = {}
            # (a rollout whose namespace holds no tip yet has nothing to find: no embedding is spent on it)
            slots = {i: self.memory.namespace_key(trajs[i].task, trajs[i].variation) for i in live if memory_mode[i, t]}
            mem_live = [i for i, slot in slots.items() if self.memory.size(slot)]
            if mem_live:
                t0 = time.perf_counter()
                queries = self.embedder.encode([self._key_text(envs[i], histories[i], obs[i]) for i in mem_live])
                keys = [slots[i] for i in mem_live]
                hits = self.memory.search(queries, keys, k=s.top_k, min_sim=s.min_sim)
                for i, found in zip(mem_live, hits):
                    tips[i] = [(rec.id, rec.text) for rec, _ in found]
                timing["memory"] += time.perf_counter() - t0

            # -- one batched generate over every live environment
            step_tips = {i: [text for _, text in tips.get(i, [])] or None for i in live}
            prompts = [self.builder.build(envs[i].task_description, histories[i], obs[i], step_tips[i],
                                          turn_tips[i] if s.tips_in_history else None) for i in live]
            t0 = time.perf_counter()
            # no draw without prompts: a rank's samples never depend on how long the rest of its group plays
            seed = self._seed(generator) if live else None
            gens = self.engine.generate([pr.ids for pr in prompts], params, seed=seed)
            timing["generate"] += time.perf_counter() - t0

            # -- environment steps
            t0 = time.perf_counter()
            still_live = []
            for i, prompt, gen in zip(live, prompts, gens):
                traj = trajs[i]
                tokens_generated += len(gen.token_ids)
                offpolicy = bool(offpolicy_mode[i, t]) and prompt.has_tips
                dropped = (not evaluate and s.drop_over_tokens is not None
                           and len(prompt.ids) + len(gen.token_ids) > s.drop_over_tokens)
                traj.dropped_steps += dropped
                sample = StepSample(
                    behaviour_ids=prompt.ids,
                    train_ids=prompt.without_tips() if offpolicy else prompt.ids,
                    response_ids=gen.token_ids, memory=prompt.has_tips, offpolicy=offpolicy,
                    group_id=traj.group_id, traj_id=traj.traj_id, step=t, engine_logprobs=gen.logprobs,
                    behaviour_logprobs=gen.logprobs if s.exact_logprobs else None, prefix_len=prompt.prefix_len)
                if not dropped:
                    traj.samples.append(sample)
                traj.tips_used.update(tip_id for tip_id, _ in tips.get(i, []))
                traj.wanted_tips |= bool(memory_mode[i, t])
                res = envs[i].step(gen.text)
                traj.ext_return += 0.0 if dropped else res.reward
                traj.score, traj.won = float(res.info.get("score", 0.0)), bool(res.info.get("won", False))
                traj.invalid_actions += int(bool(res.info.get("invalid_action", False)))
                if res.info.get("env_error"):
                    traj.env_error = str(res.info["env_error"])
                # the released chat shows the raw output as the past action (its `record_original_action`)
                raw_action = self.builder.template == "released"
                histories[i].append((obs[i], gen.text if raw_action else res.info.get("parsed_action") or gen.text))
                turn_tips[i].append(step_tips[i])
                obs[i] = res.obs
                if not res.done:
                    still_live.append(i)
            if not evaluate and s.intrinsic == "retrieval":  # tips retrieved per step; 1/(count+1) is taken below
                for i in live:
                    trajs[i].intrinsic.append(len(tips.get(i, [])))
            elif not evaluate:  # visit counts n(s) of the states this step led to; 1/n(s) is taken below
                for i, n in zip(live, self.novelty.visit_step([envs[i].state_key() for i in live])):
                    trajs[i].intrinsic.append(n)
            live = still_live
            timing["env"] += time.perf_counter() - t0
            if on_step is not None:
                on_step(n_traj - len(live), n_traj)

        new_tips, tips_added = None, 0
        if not evaluate and s.write_tips and has_memory:
            new_tips = self._write_tips(trajs, envs, histories, turn_tips, obs, iteration, generator, timing)
            t0 = time.perf_counter()
            if self.add_tips and new_tips[0]:
                tips_added = len(self.memory.add(*new_tips))
            timing["memory"] += time.perf_counter() - t0

        self._assign_advantages(trajs, evaluate, memory_mode)
        if has_memory and not evaluate:
            for traj in trajs:
                if traj.tips_used:
                    self.memory.update_utility(sorted(traj.tips_used), traj.ext_return)
        samples = [smp for traj in trajs for smp in traj.samples]
        stats = self._stats(trajs, samples, tips_added, tokens_generated, timing, time.perf_counter() - t_start)
        return RolloutBatch(samples=samples, trajectories=trajs, stats=stats, new_tips=new_tips)

    # ------------------------------------------------------------------------------------------ pieces
    def _key_text(self, env: TextEnv, history: list[tuple[str, str]], observation: str) -> str:
        """What retrieval compares (`key_text`): the task and the current observation, or the whole chat so
        far (the released code embeds the step's chat-history text)."""
        if self.settings.key_text == "history" and self.builder.template == "released":
            return released_chat_text(env.task_description, history, observation)
        if self.settings.key_text == "history":
            turns = "".join(f"{o}\n> {a}\n" for o, a in history)
            return f"{env.task_description}\n{turns}{observation}"
        return f"{env.task_description}\n{observation}"

    @staticmethod
    def _seed(generator: torch.Generator) -> int:
        return int(torch.randint(0, 2**31 - 1, (1,), generator=generator))

    def _write_tips(self, trajs, envs, histories, turn_tips, obs, iteration: int, generator: torch.Generator,
                    timing: dict):
        """The policy writes one tip per finished episode, in one batched call, from the whole episode chat
        (with the tips its turns carried under `tips_in_history`); tips are sanitised (a tip can never open
        a chat turn) and keyed by the embedding of the episode's final state (per-step entries: of their own
        step's state, or all of the final one with `step_entry_key="final"`). Returns the memory entries
        (texts, keys, metas)."""
        s = self.settings
        requests = [self.builder.build_tip_request(envs[i].task_description, histories[i], obs[i], s.max_tip_words,
                                                   turn_tips[i] if s.tips_in_history else None)
                    for i in range(len(trajs))]
        params = SamplingParams(temperature=s.tip_temperature, top_p=1.0, max_new_tokens=s.tip_max_new_tokens,
                                stop_at_newline=False, kind="tip")
        t0 = time.perf_counter()
        gens = self.engine.generate(requests, params, seed=self._seed(generator))
        timing["tips"] += time.perf_counter() - t0  # tip generation; sanitising and embedding count as memory
        t0 = time.perf_counter()
        texts, keys, metas = [], [], []
        for i, (traj, gen) in enumerate(zip(trajs, gens)):
            tip = gen.text if s.tip_format == "raw" else sanitize_tip(gen.text, s.max_tip_words, self.special_tokens)
            if tip == "" and not s.per_step_entries:  # a raw empty output: nothing to store (a step entry never is)
                tip = None
            traj.tip = tip
            if tip is None:
                continue
            meta = {"task": traj.task, "variation": traj.variation, "episode_return": traj.ext_return,
                    "iteration": iteration, "source_rank": self.rank}
            actions = [a for _, a in histories[i]]
            entry_texts, entry_metas = episode_entries(tip, meta, s.per_step_entries, actions, traj.score,
                                                       released=s.tip_format == "raw")
            final_key = self._key_text(envs[i], histories[i], obs[i])
            if s.per_step_entries and s.step_entry_key == "step":  # the state each step acted in
                keys += [self._key_text(envs[i], histories[i][:m["step"]], histories[i][m["step"]][0])
                         for m in entry_metas]
            else:
                keys += [final_key] * len(entry_texts)
            texts += entry_texts
            metas += entry_metas
        vectors = self.embedder.encode(keys) if keys else np.zeros((0, self.memory.dim), dtype=np.float32)
        timing["memory"] += time.perf_counter() - t0
        return texts, vectors, metas

    def _assign_advantages(self, trajs: list[Trajectory], evaluate: bool, memory_mode: torch.Tensor) -> None:
        s = self.settings
        ext = torch.tensor([tr.ext_return for tr in trajs], dtype=torch.float64)  # (R,)
        if evaluate:
            rets = ext
        else:
            counts = [torch.tensor(tr.intrinsic, dtype=torch.float64) for tr in trajs]
            if s.intrinsic == "retrieval":  # r_int = 1/(retrieved + 1) on memory-mode steps, 0 elsewhere
                bonuses = [core_algos.retrieval_bonus(c, memory_mode[i, :len(c)]) for i, c in enumerate(counts)]
            else:
                bonuses = [core_algos.count_bonus(c) if len(c) else c for c in counts]  # r_int(s) = 1/n(s)
            for tr, b in zip(trajs, bonuses):
                tr.intrinsic = b.tolist()
            intrinsic_sums = torch.stack([b.sum() for b in bonuses])  # (R,)
            # the released code's bonus lands in token_level_rewards, which its advantage never reads
            rets = core_algos.mix_returns(ext, intrinsic_sums, s.beta) if s.intrinsic_in_advantage else ext
        group_ids = torch.tensor([tr.group_id for tr in trajs], dtype=torch.long)
        adv = core_algos.group_advantages(rets, group_ids, s.normalize_std, s.adv_eps)  # (R,)
        for tr, r, a in zip(trajs, rets.tolist(), adv.tolist()):
            tr.ret = r
            for smp in tr.samples:
                smp.advantage = a

    def _stats(self, trajs, samples, tips_added, tokens, timing, wall) -> dict[str, float]:
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
            "rollout/tokens_generated": float(tokens),
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
        stats.update({f"time/{k}_s": v for k, v in timing.items()})
        return stats

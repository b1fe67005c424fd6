"""The rounds that make the shipped tip readers from `minisci_tips`: it plays its own episodes and learns from them.

The scripted episodes of `recipes.minisci_priors.prior_tips` teach the prior to write tips about *scripted* play,
where what an episode did is also what its task and house predict (the prior-driven agent always takes the same
look-alike), so a tip can be guessed without reading the episode. Its own episodes are not like that: it focuses on
whichever look-alike it samples. `self_play_examples` gives tip-writing examples from episodes the prior plays itself,
labelled with what those episodes showed (DAgger for the tip writer); reports/minisci_priors reports what each
kind of round changed.

Each round (`run_round`) plays the model through the real rollout worker, labels what its own episodes reached
(DAgger for the tip writer: `self_play_examples`; for the reader: `reader_examples`; at the decision states where
the gold path and the trapped one part: `decision_examples`, optionally with a signature-match head), and
fine-tunes on those examples mixed with its stage-1 sequences. `SHIPPED` holds, for each shipped prior made this
way, the stage-1 settings and the rounds its `empo2_source.json` records;
`python -m recipes.minisci_priors.prior_rounds build NAME --out DIR` replays them from scratch.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import random
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from empo2.config import load_config
from empo2.config.presets import MINISCI_TIPS_LAYOUT
from empo2.envs import make_env
from empo2.envs.base import TaskSpec
from empo2.envs.minisci import FAMILIES, OOD_FAMILIES
from empo2.envs.minisci.env import build
from empo2.envs.minisci.layout import Difficulty
from empo2.memory import TipMemory
from empo2.models.io import RECIPE_BUILD, save_cached_checkpoint, shipped_prior
from empo2.rollout.build import build_worker, env_kwargs
from empo2.rollout.engines.base import SamplingParams
from empo2.rollout.spec import collection_spec
from empo2.rollout.worker import draw_seed
from empo2.utils import quiet_libraries
from recipes.minisci_priors.prior import (
    CONTEXT,
    IGNORED,
    SOFT,
    TARGET,
    behaviour_clone,
    dev_instances,
    ensure_minisci_bc,
)
from recipes.minisci_priors.prior_tips import (
    KINDS,
    SIGNATURE_HEAD,
    Episode,
    TipPriorSettings,
    cached_prior,
    ensure_minisci_tips,
    hindsight_tip,
    play,
    prompt_builder,
    scripted,
    tips_signed,
)

IN_DISTRIBUTION = [f for f in FAMILIES if f not in OOD_FAMILIES]
SELF_PLAY_CHUNK = 64  # instances played side by side (one generate call per step over all of them)


class _TipRequests:
    """The rollout worker's engine, keeping the last batch of tip requests it was asked to complete: exactly the
    prompts the worker built from its own episode chats (tip requests are its only calls that do not stop at
    a newline)."""

    def __init__(self, engine) -> None:
        self.engine, self.prompts = engine, []

    def generate(self, prompts, params, seed=None):
        if not params.stop_at_newline:
            self.prompts = [list(p) for p in prompts]
        return self.engine.generate(prompts, params, seed=seed)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def _own_play(model, tok, max_turns: int, variations_per_family: int | None, seed: int, shuffle: bool = False):
    """The rollout worker and collection as calibration and RL run them (memory on, p = 1) and the dev instances it
    plays, one house draw each (one tip namespace per instance): the first `variations_per_family` of each family,
    or all; family by family, or with `shuffle` in an order drawn from `seed` (so that a chunk holds every family).
    Yields, per chunk of instances played side by side, (instances done, chunk, worker with the chunk's envs (its
    memory and novelty counter shared by every chunk), collection spec, replay envs of the same houses, task
    specs)."""

    cfg = load_config(["env=minisci", "model=minisci_tips", "algo.p=1", "algo.q=0", f"env.max_steps={max_turns}",
                       "rollout.max_new_tokens=16", "rollout.tip_max_new_tokens=64", f"seed={seed}"])
    instances = list(dev_instances(random.Random(seed + 2), 1))
    if variations_per_family:
        first: dict[str, list[int]] = {}
        for family, variation, _ in instances:
            first.setdefault(family, []).append(variation)
        instances = [i for i in instances if i[1] in first[i[0]][:variations_per_family]]
    if shuffle:
        random.Random(seed).shuffle(instances)
    worker, spec = build_worker(cfg, model, tok, 1), collection_spec(cfg)
    for start in range(0, len(instances), SELF_PLAY_CHUNK):
        chunk = instances[start:start + SELF_PLAY_CHUNK]
        envs = [make_env("minisci", **{**env_kwargs(cfg), **house}) for _, _, house in chunk]
        replay_envs = [make_env("minisci", **{**env_kwargs(cfg), **house, "max_steps": 100}) for _, _, house in chunk]
        yield ((start + len(chunk), len(instances)), chunk, worker.using(envs=envs), spec, replay_envs,
               [TaskSpec(f, v) for f, v, _ in chunk])


def _actions(traj, tok) -> list[str]:
    """The texts a worker's trajectory gave the env (Generation.text: the response up to its first newline)."""
    return [tok.decode(s.response_ids, skip_special_tokens=True).split("\n", 1)[0].strip() for s in traj.samples]


def replay(env, family: str, variation: int, house: dict, traj, tok, max_turns: int) -> Episode | None:
    """The episode a worker's trajectory played, replayed in `env` (the same house) from the texts the policy
    generated, with what a hindsight tip may say about it; None if the replay does not end where the trajectory
    did (then a label would describe another episode)."""
    actions = _actions(traj, tok)
    ep = play(env, family, variation, house, actions, max_turns)
    return ep if ep.score == traj.score and len(ep.turns) == len(actions) else None


def self_play_examples(model, tok, episodes_per_instance: int = 3, max_turns: int = 10,
                       variations_per_family: int | None = None, seed: int = 0, signature: bool = False,
                       log=print) -> tuple[list[tuple[list[int], list[int]]], dict]:
    """(ids, kinds) per episode the model plays on a dev variation (`_own_play`): its own tip request, then, as
    the target, the hindsight tip of that episode, labelled by replaying its actions in the same house (build-time
    bookkeeping, as every label here). `episodes_per_instance` episodes one after another, each retrieving the
    tips it wrote after the earlier ones, `max_turns` steps each. The request is IGNORED: only the tip is learned,
    not its own actions or its earlier, possibly false, tips. Returns the examples and play statistics
    (`tips_exact`: its own tip was the label, word for word)."""
    generator = torch.Generator().manual_seed(seed)
    examples, stats = [], {"episodes": 0, "score": 0.0, "tips_exact": 0, "unreplayable": 0}
    eos = tok.eos_token_id
    for (done, total), chunk, worker, spec, replay_envs, tasks in _own_play(model, tok, max_turns,
                                                                            variations_per_family, seed):
        requests = _TipRequests(worker.engine)
        worker = worker.using(engine=requests)
        for r in range(episodes_per_instance):
            batch = worker.collect(spec, tasks, 1, iteration=r, generator=generator)
            for (family, variation, house), env, traj, request in zip(chunk, replay_envs, batch.trajectories,
                                                                       requests.prompts):
                ep = replay(env, family, variation, house, traj, tok, max_turns)
                if ep is None:
                    stats["unreplayable"] += 1
                    continue
                tip = hindsight_tip(ep, signature)
                stats["episodes"] += 1
                stats["score"] += ep.score
                stats["tips_exact"] += traj.tip == tip
                target = tok.encode(tip, add_special_tokens=False) + [eos]
                examples.append((request + target, [IGNORED] * len(request) + [TARGET] * len(target)))
        log(f"self-play: {done}/{total} instances x {episodes_per_instance} episodes, "
            f"tips exact {stats['tips_exact']}/{stats['episodes']}")
    stats["score"] /= max(stats["episodes"], 1)
    return examples, stats


# A reader that has the gold path's tip in its prompt still wins a minority of episodes: it names the thing the tip
# names, but walks to another room, or focuses on it where it is not. Its mistakes compound where the scripted
# episodes never went (a wrong room, a second hallway), so `reader_examples` labels the states its own tip-reading
# episodes reach (DAgger for the reader).

def expert_labels(env, family: str, variation: int, actions: list[str]) -> list[str]:
    """The expert's action at each state `actions` reach from a reset while the expert can plan from it: while
    every action so far was a move, the world is as it started but for where the agent stands, and the gold plan
    from there (`Task.gold`, planned on the current world) is a shortest winning path. One label per action up to
    and including the first that is not a move (the focus, say), fewer if the episode ends first."""
    env.reset(task=family, variation=variation)
    labels = []
    for action in actions:
        plan = env._task.gold(env._world)  # build-time labelling from the true house, never a prompt
        if not plan:
            break
        labels.append(plan[0])
        result = env.step(action)
        if result.done or not (result.info["action"] or "go to ").startswith("go to "):
            break  # (an action the env could not resolve changed nothing)
    return labels


def foreign_tips(chunk, played: list, rng: random.Random, same_family: bool = True,
                 allowed=None) -> list[list]:
    """Per instance of `chunk` ((family, variation, house) each), 1-3 of the entries `played` holds for one other
    instance: of the same family and another variation (`same_family`: another house's tips, which read like
    this one's) or of another family (another task's); none for an instance that has no such other in the chunk.
    `allowed(i, j)`, if given, must also hold for instance i to borrow from instance j."""
    out = []
    for i, (family, variation, _) in enumerate(chunk):
        donors = [j for j, (f, v, _) in enumerate(chunk) if (f == family and v != variation if same_family else
                                                             f != family) and (allowed is None or allowed(i, j))]
        out.append(rng.sample(played[rng.choice(donors)], rng.randint(1, 3)) if donors else [])
    return out


def outside_category(chunk) -> Callable[[int, int], bool]:
    """For `foreign_tips`: find-living-thing instance i may borrow from instance j when j's target is a thing
    i's task could never accept (a plant's tips for "find an animal"). A tip about another house whose thing the
    task does admit says what a true tip would (that thing, a room, a won episode), and labelling it with the
    tip-free action would teach the opposite of the gold tips' examples on prompts that cannot be told apart;
    one whose thing the task cannot admit is told apart by what it says. No other family has such instances."""

    tasks = [build(f, v, Difficulty(**house))[1] if f == "find-living-thing" else None for f, v, house in chunk]
    return lambda i, j: (tasks[i] is not None and tasks[j] is not None
                         and tasks[j].target not in tasks[i].candidates)


@torch.no_grad()
def next_token_distributions(model, prompts: list[list[int]], targets: list[list[int]],
                             batch_size: int = 16) -> list[torch.Tensor]:
    """Per (prompt, target) pair, the model's next-token distribution (softmax of its logits: temperature 1, no
    top-p, so that matching it matches the policy under any sampling settings) at each token of the target, given
    the prompt and the target's earlier tokens: (len(target), V) each. Right-padded batches without a mask, as
    in `behaviour_clone`: attention is causal, so no real position sees a pad."""
    out = []
    for start in range(0, len(prompts), batch_size):
        seqs = [p + t for p, t in zip(prompts[start:start + batch_size], targets[start:start + batch_size])]
        ids = torch.zeros((len(seqs), max(map(len, seqs))), dtype=torch.long)  # (B, T)
        for i, seq in enumerate(seqs):
            ids[i, :len(seq)] = torch.tensor(seq)
        probs = torch.softmax(model(input_ids=ids).logits.float(), dim=-1)  # (B, T, V)
        for i, (p, t) in enumerate(zip(prompts[start:start + batch_size], targets[start:start + batch_size])):
            out.append(probs[i, len(p) - 1:len(p) - 1 + len(t)].clone())  # position k predicts token k + 1
    return out


def action_log_probs(model, tok, prompt: list[int], actions: list[str]) -> torch.Tensor:
    """The policy's log-probability of answering `prompt` with each of `actions` (its tokens, then end of turn), by
    teacher forcing: (len(actions),) float64, summed over tokens (a product of probabilities underflows)."""
    targets = [tok.encode(a, add_special_tokens=False) + [tok.eos_token_id] for a in actions]
    dists = next_token_distributions(model, [prompt] * len(actions), targets)
    return torch.stack([d[torch.arange(len(t)), torch.tensor(t)].double().log().sum() for d, t in zip(dists, targets)])


def contrast_twins(worker, spec, env, family: str, variation: int, actions: list[str], tips: list[str]) -> list:
    """For `reader_examples(contrast=True)`: at each state the first len(actions) steps of an episode reach, the
    prompt the rollout worker would build there under `spec` with `tips` in every tip block (the same history,
    recorded as the worker records it: each action as the env parsed it), and its tip-free prompt: (prompt, None,
    tip-free)."""
    obs, info = env.reset(task=family, variation=variation)
    history: list[tuple[str, str]] = []
    in_history = spec.tips_in_history
    twins = []
    for t, action in enumerate(actions):
        prompt = worker.builder.build(info["task_description"], history, obs, tips, [tips] * t if in_history
                                         else None)
        twins.append((prompt.ids, None, prompt.without_tips()))
        result = env.step(action)
        history.append((obs, result.info.get("parsed_action") or action))
        obs = result.obs
    return twins


def reader_examples(model, tok, max_turns: int = 10, variations_per_family: int | None = None, seed: int = 0,
                    foreign: str | None = None, signature: bool = False, distill: bool = False,
                    contrast: bool = False, log=print) -> tuple[list[tuple], dict]:
    """(ids, kinds) per state the model reaches acting on tips (DAgger for the reader; with `distill`, (ids, kinds,
    probs) under tips that do not apply): each dev instance (`_own_play`) is played once through the rollout worker
    with a memory holding scripted episodes' hindsight tips, keyed as the rollout worker keys its own; every example is
    the rollout worker's own prompt at a state its episode reached (IGNORED), then a label and end of turn (TARGET).
    Returns the examples and play statistics (`agreed`: states where its action was the label).

    - no `foreign`: the tips are the gold path's, with 0-2 of other scripted episodes of the same instance
      (prior-driven, careful search) as a LOCATED sequence has them. The states are those reached while only
      moving, labelled with the expert's action there (`expert_labels`): the tips say where what the task
      needs is, so the label asks only for what they tell.
    - `foreign="house"` or `"task"`: the tips are 1-3 of the scripted episodes of another dev instance, of the same
      family and another variation (another house: nothing in them is about this house, though they read like
      tips that are; keyed as the donor's) or of another family (another task; keyed as this instance's own gold
      path's tip, so retrieval finds them as it would its own; the instances are shuffled so that every chunk
      holds every family). Every state reached is labelled with the action the model itself samples from the
      tip-free prompt of that state (the same history with every tip block cut out): the tip-free policy distilled into
      prompts whose tips do not apply, so that it learns to use what a tip says, not that a tip is there. With
      `distill` the label is the whole next-token distribution of the tip-free prompt along that sampled action
      (SOFT targets, `next_token_distributions`): the same target in expectation, without one sample's noise.
    - `foreign="category"`: as "house", with only the houses whose target the task's category does not admit
      (`outside_category`; find-living-thing only, other families borrow none).
    - `contrast` (no `foreign`, signed tips): each state labelled under the instance's own tips also gets a twin,
      the same history and observation with 1-3 of another house's tips in its tip blocks (`contrast_twins`),
      labelled from its tip-free prompt as under `foreign` (with `distill` too): two prompts that differ only in
      whose instance their tips are about, with different labels, so that the signature is what tells them apart."""

    rng = random.Random(seed)
    donor_rng = random.Random(seed + 1)
    generator = torch.Generator().manual_seed(seed)
    examples, stats = [], {"episodes": 0, "score": 0.0, "states": 0, "agreed": 0, "twins": 0}
    eos = tok.eos_token_id
    if foreign not in (None, "house", "category", "task"):
        raise ValueError(f"foreign must be None, 'house', 'category' or 'task', got {foreign!r}")
    if distill and not (foreign or contrast):
        raise ValueError("distill labels states under another instance's tips (foreign or contrast); the expert's "
                         "labels under the instance's own tips are single actions")
    if contrast and (foreign or not signature):
        raise ValueError("contrast pairs states under the instance's own tips (no foreign) with their twins under "
                         "another house's, which only signed tips (signature) tell apart")
    for (done, total), chunk, worker, spec, replay_envs, tasks in _own_play(model, tok, max_turns,
                                                                            variations_per_family, seed,
                                                                            shuffle=foreign == "task"):
        played, own_tips = [], []  # per instance: (tip, key text, score) of its scripted episodes; the gold set
        for (family, variation, house), env in zip(chunk, replay_envs):
            env.reset(task=family, variation=variation)
            gold = play(env, family, variation, house, env.gold_actions(), max_turns)
            others = [play(env, family, variation, house, scripted(rng, trap=trap), max_turns)
                      for trap in (True, False)]
            tips = [(hindsight_tip(ep, signature), worker.retrieval_key(spec, env, ep.turns, ep.final_obs), ep.score)
                    for ep in (gold, *others)]
            played.append(tips)
            own_tips.append([tips[0], *rng.sample(tips[1:], rng.randint(0, 2))])
        texts, keys, metas = [], [], []
        allowed = outside_category(chunk) if foreign == "category" else None
        chosen = foreign_tips(chunk, played, donor_rng, foreign != "task", allowed) if foreign else own_tips
        for (family, variation, _), tips, own in zip(chunk, chosen, played):
            for text, key, score in tips:
                key = own[0][1] if foreign == "task" else key
                texts.append(text)
                keys.append(key)
                metas.append({"task": family, "variation": variation, "episode_return": score / 100})
        like = worker.memory
        worker = worker.using(memory=TipMemory(like.dim, **{k: v for k, v in like.config().items() if k != "dim"}))
        worker.memory.add(texts, worker.embedder.encode(keys), metas)
        # every step with tips also records its tip-free prompt (`train_ids`)
        reading = dataclasses.replace(spec, write_tips=False, q=1.0)
        batch = worker.collect(reading, tasks, 1, iteration=0, generator=generator)
        borrowed = foreign_tips(chunk, played, donor_rng) if contrast else [[]] * len(chunk)
        # (prompt with tips, action taken there, label, its distribution or None); pending: the tip-free prompt to
        # label from in place of the label
        labelled, pending = [], []
        for (family, variation, _), env, traj, twin_tips in zip(chunk, replay_envs, batch.trajectories, borrowed):
            stats["episodes"] += 1
            stats["score"] += traj.score
            actions = _actions(traj, tok)
            if not foreign:
                labels = expert_labels(env, family, variation, actions)
                labelled += [(smp.behaviour_ids, a, label, None) for smp, a, label in
                             zip(traj.samples, actions, labels)]
                if twin_tips:
                    pending += contrast_twins(worker, spec, env, family, variation, actions[:len(labels)],
                                              [text for text, _, _ in twin_tips])
            else:
                pending += [(smp.behaviour_ids, a, smp.train_ids) for smp, a in zip(traj.samples, actions)
                            if smp.memory]
        if pending:  # the labels: one sample each from the tip-free prompts
            params = SamplingParams(temperature=spec.temperature, top_p=spec.top_p, max_new_tokens=spec.max_new_tokens)
            tip_free = [tip_free for _, _, tip_free in pending]
            gens = worker.engine.generate(tip_free, params, seed=draw_seed(generator))
            labels = [gen.text.strip() for gen in gens]
            targets = [tok.encode(label, add_special_tokens=False) + [eos] for label in labels]
            soft = next_token_distributions(model, tip_free, targets) if distill else [None] * len(pending)
            pending = [(prompt, action, label, probs) for (prompt, action, _), label, probs in
                       zip(pending, labels, soft)]
        stats["twins"] += len(pending) * contrast
        for prompt, action, label, probs in labelled + pending:
            target = tok.encode(label, add_special_tokens=False) + [eos]
            if action is not None:  # (a twin's state was reached under the instance's own tips)
                stats["states"] += 1
                stats["agreed"] += action == label
            if probs is None:
                examples.append((prompt + target, [IGNORED] * len(prompt) + [TARGET] * len(target)))
            else:
                examples.append((prompt + target, [IGNORED] * len(prompt) + [SOFT] * len(target), probs))
        under = f" (another {foreign}'s tips)" if foreign else ""
        log(f"reader{under}: {done}/{total} instances, score "
            f"{stats['score'] / stats['episodes']:.1f}, label taken at {stats['agreed']}/{stats['states']} states"
            + (f", {stats['twins']} twins under another house's tips" if contrast else ""))
    stats["score"] /= max(stats["episodes"], 1)
    return examples, stats


# ------------------------------------------------------------------------------------- decision states
# The rounds above label every state an episode reaches, and at most of them the gold path and the prior-driven
# agent take the same step (out of the start room, down the hall), so a pair of prompts that differ only in whose
# instance their tips are about mostly shares its label: the signature decides almost nothing there. It decides at
# the state where the two paths part, where a true tip should turn the prior from its trap and another house's
# should not. `decision_examples` trains there only, on many more houses than a round plays.


@dataclass
class DecisionState:
    """The first state at which an instance's gold path and its prior-driven trapped path take different actions,
    reached along the gold path's common prefix with that path."""

    family: str
    variation: int
    house: dict
    gold: Episode
    trapped: Episode
    task: str
    turns: list[tuple[str, str]]  # (observation, action) up to the state
    obs: str
    actions: list[str]  # the valid actions there
    good: str  # the gold path's action there

    def own_tips(self, rng: random.Random, signature: str | None = None) -> list[str]:
        """The gold path's signed tip, with the trapped episode's half the time (as a memory holds both); with
        `signature`, the same tips signed as if about the instance it names (`resign`)."""
        tips = {hindsight_tip(self.gold, True)}
        if rng.random() < 0.5:
            tips.add(hindsight_tip(self.trapped, True))
        return sorted(resign(tip, signature) if signature is not None else tip for tip in tips)


def resign(tip: str, signature: str) -> str:
    """A signed tip with its signature replaced: word for word the same tip, said of another instance."""
    if not tip.startswith(SIGNATURE_HEAD):
        raise ValueError(f"not a signed tip: {tip!r}")
    return f"{SIGNATURE_HEAD}{signature}.{tip[tip.index('. ', len(SIGNATURE_HEAD)) + 1:]}"


def decision_states(instances, max_turns: int = 10, seed: int = 0) -> list[DecisionState]:
    """The `DecisionState` of each (family, variation, house) in `instances` whose gold path and trapped path
    (`scripted(trap=True)`, its look-alike taken) part within `max_turns` steps; build-time play on the true house,
    as every label here is."""

    rng = random.Random(seed)
    out = []
    for family, variation, house in instances:
        env = make_env("minisci", max_steps=100, **house)
        env.reset(task=family, variation=variation)
        gold = play(env, family, variation, house, env.gold_actions(), max_turns)
        trapped = play(env, family, variation, house, scripted(rng, trap=True), max_turns)
        paths = zip((a for _, a in gold.turns), (a for _, a in trapped.turns))
        k = next((i for i, (a, b) in enumerate(paths) if a != b), None)
        if k is None:  # (the prior's room is on the gold path's way and nothing tempts before it ends)
            continue
        obs, info = env.reset(task=family, variation=variation)
        turns = []
        for _, action in gold.turns[:k]:
            turns.append((obs, action))
            obs = env.step(action).obs
        out.append(DecisionState(family, variation, house, gold, trapped, info["task_description"], turns, obs,
                                 env.valid_actions(), gold.turns[k][1]))
    return out


def decision_prompt(builder, state: DecisionState, tips: list[str] | None) -> list[int]:
    """The rollout worker's prompt at the state with `tips` in every turn's tip block (the whole-chat layout)."""
    return builder.build(state.task, state.turns, state.obs, tips, [tips] * len(state.turns) if tips else None).ids


def another_house(states: list[DecisionState], i: int, rng: random.Random) -> DecisionState | None:
    """A state of another instance of `states[i]`'s family whose task's signature differs (a shared signature
    would read as its own), or None."""
    me = states[i]
    others = [s for s in states if s.family == me.family and s.gold.signature != me.gold.signature]
    return rng.choice(others) if others else None


def decision_examples(model, tok, states: list[DecisionState], foreign_per_state: int = 2,
                      seed: int = 0, resigned: bool = False) -> list[tuple]:
    """Per decision state, examples whose prompts differ only in their tips, each the rollout worker's prompt (CONTEXT,
    so the build's next-token loss keeps the language) then a label and end of turn:

    - under the instance's own signed tips (`DecisionState.own_tips`): the gold path's action (TARGET);
    - under `foreign_per_state` sets of another house's signed tips (`another_house`, its own tips as above): the
      tip-free policy's whole next-token distribution along an action sampled from it there (SOFT): tips about
      another instance should change nothing; with `resigned`, the instance's own tips re-signed with another
      house's signature instead (`resign`), so that the signature is the only word that tells the two prompts
      apart and what a tip says cannot;
    - tip-free, the same (an anchor: what the signature teaches must not move the tip-free policy, the trap a
      run starts from).

    Labels come from `model` as it is when called; signed tips only (the signature is what tells the prompts
    apart)."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    builder = prompt_builder(tok)

    def encode(action: str) -> list[int]:
        return tok.encode(action, add_special_tokens=False) + [tok.eos_token_id]

    examples, soft_prompts, soft_targets, tip_free = [], [], [], []
    for i, state in enumerate(states):
        prompt, target = decision_prompt(builder, state, state.own_tips(rng)), encode(state.good)
        examples.append((prompt + target, [CONTEXT] * len(prompt) + [TARGET] * len(target)))
        free = decision_prompt(builder, state, None)
        with torch.no_grad():
            log_p = action_log_probs(model, tok, free, state.actions)  # (len(actions),)
        donors = [another_house(states, i, rng) for _ in range(foreign_per_state)]
        prompts = [decision_prompt(builder, state, state.own_tips(rng, donor.gold.signature) if resigned
                                   else donor.own_tips(rng)) for donor in donors if donor]
        for prompt in [*prompts, free]:
            pick = torch.multinomial(torch.softmax(log_p, 0).float(), 1, generator=generator)
            soft_prompts.append(prompt)
            soft_targets.append(encode(state.actions[int(pick)]))
            tip_free.append(free)
    with torch.no_grad():
        soft = next_token_distributions(model, tip_free, soft_targets)
    examples += [(p + t, [CONTEXT] * len(p) + [SOFT] * len(t), q) for p, t, q in zip(soft_prompts, soft_targets, soft)]
    return examples


def decision_shift(model, tok, states: list[DecisionState], seed: int = 0, signature: bool = True) -> dict:
    """At each decision state, the policy's probability of the gold path's action (over the valid actions,
    teacher-forced: exact) tip-free, under the instance's own gold tip and under another house's gold tip (signed,
    or not for a prior trained on unsigned tips), and the KL from tip-free of each; means over `states`. Signed,
    also under its own gold tip re-signed with that house's signature (`resigned`: the same words but whose tip it
    is). A policy that reads the signature moves under its own tip and stays under the other two."""
    rng = random.Random(seed)
    builder = prompt_builder(tok)
    rows = []
    for i, state in enumerate(states):
        donor = another_house(states, i, rng)
        if donor is None or state.good not in state.actions:
            continue
        tips = {"tip_free": None, "own": [hindsight_tip(state.gold, signature)],
                "other_house": [hindsight_tip(donor.gold, signature)]}
        if signature:
            tips["resigned"] = [resign(hindsight_tip(state.gold, True), donor.gold.signature)]
        with torch.no_grad():
            log_p = {k: action_log_probs(model, tok, decision_prompt(builder, state, t), state.actions)
                     for k, t in tips.items()}
        log_p = {k: v - v.logsumexp(0) for k, v in log_p.items()}  # normalised over the valid actions
        good = state.actions.index(state.good)
        base = log_p["tip_free"]
        rows.append({k: {"gold": v[good].exp().item(), "kl": (base.exp() * (base - v)).sum().item()}
                     for k, v in log_p.items()})
    if not rows:
        return {"states": 0}
    means = {k: {m: sum(r[k][m] for r in rows) / len(rows) for m in ("gold", "kl")} for k in rows[0]}
    return means | {"states": len(rows)}


def signature_match_examples(tok, states: list[DecisionState], seed: int = 0) -> list[tuple]:
    """What reading the signature computes, as a target of its own
    (recipes/minisci_priors/research/minisci_signature_probe.py). Per decision state, the rollout worker's prompt
    under the gold path's signed tip and under the same tip re-signed with another house's signature (`resign`), as
    (ids, positions, labels): at the last token of each field of the signature (the words between its commas: box
    and room, the component) in every tip block, 1.0 where that field is the instance's own; at the prompt's last
    token, where the reader answers, 1.0 where the whole signature is. The two prompts differ in the signature alone,
    so nothing else can tell them apart."""
    rng = random.Random(seed)
    builder = prompt_builder(tok)
    out = []
    for i, state in enumerate(states):
        donor = another_house(states, i, rng)
        if donor is None:
            continue
        own = state.gold.signature
        for signature in (own, donor.gold.signature):
            ids = decision_prompt(builder, state, [resign(hindsight_tip(state.gold, True), signature)])
            text, ends = _decode_with_ends(tok, ids)
            said = f"{SIGNATURE_HEAD}{signature}."
            positions, labels = [], []
            at = text.find(said)
            while at >= 0:
                start = at + len(SIGNATURE_HEAD)
                for field, mine in zip(signature.split(", "), own.split(", "), strict=True):
                    start = text.index(field, start) + len(field)  # the field's last character ends here
                    positions.append(bisect.bisect_left(ends, start))  # the token that holds that character
                    labels.append(float(field == mine))
                at = text.find(said, start)
            out.append((ids, [*positions, len(ids) - 1], [*labels, float(signature == own)]))
    return out


def signature_match_batches(tok, states: list[DecisionState], seed: int = 0, size: int = 8):
    """Endless shuffled batches of `signature_match_examples`, another house redrawn per state every pass (so
    no one pairing of signatures is learned by heart)."""
    rng, data = random.Random(seed), []
    while True:
        if len(data) < size:
            data = signature_match_examples(tok, states, seed=rng.randrange(2**31))
            rng.shuffle(data)
        batch, data = data[:size], data[size:]
        yield batch


def signature_match_logits(model, head: torch.nn.Module, batch: list[tuple]) -> torch.Tensor:
    """The match head's logits at every labelled position of a batch of `signature_match_examples`, in order
    (labelled positions,): `head` (width -> 1) on the model's last hidden layer there."""
    width = max(len(ids) for ids, _, _ in batch)
    ids = torch.tensor([ids + [0] * (width - len(ids)) for ids, _, _ in batch])  # (B, T); right padding, causal
    last = model.model(input_ids=ids).last_hidden_state  # (B, T, width)
    return torch.cat([head(last[n, pos]).squeeze(-1) for n, (_, pos, _) in enumerate(batch)])


def signature_match_loss(model, head: torch.nn.Module, batch: list[tuple]) -> torch.Tensor:
    """Mean binary cross-entropy of the match head over a batch of `signature_match_examples`."""
    labels = torch.tensor([x for _, _, ls in batch for x in ls])
    return torch.nn.functional.binary_cross_entropy_with_logits(signature_match_logits(model, head, batch), labels)


def signature_match_accuracy(model, head: torch.nn.Module, examples: list[tuple]) -> dict:
    """How often the match head is right (logit > 0 for a match) on `signature_match_examples`: at the prompt's
    last token ("answer") and at the signature fields ("fields")."""
    was_training, hits = model.training, {"answer": [], "fields": []}
    model.eval()
    with torch.no_grad():
        for k in range(0, len(examples), 16):
            batch = examples[k:k + 16]
            right = ((signature_match_logits(model, head, batch) > 0).float()
                     == torch.tensor([x for _, _, ls in batch for x in ls])).tolist()
            for _, pos, _ in batch:  # each example's labels: its fields, then the answer
                hits["fields"] += right[:len(pos) - 1]
                hits["answer"].append(right[len(pos) - 1])
                right = right[len(pos):]
    model.train(was_training)
    return {k: sum(v) / len(v) for k, v in hits.items()}


def _decode_with_ends(tok, ids: list[int]) -> tuple[str, list[int]]:
    """`tok.decode(ids)` and where each token ends in it (character offsets, non-decreasing)."""
    text = tok.decode(ids)
    ends, n = [], 0
    for i in ids:
        n += len(tok.decode([i]))
        ends.append(n)
    if n != len(text):
        raise ValueError("the tokenizer does not decode token by token; offsets would be wrong")
    return text, ends


# ------------------------------------------------------------------------------------- rounds and shipped builds
ROUND_COMMAND = "python -m recipes.minisci_priors.prior_rounds round"


def round_parser() -> argparse.ArgumentParser:
    """The options of one `run_round` call (a command line, so that a checkpoint records how it was made as a
    command anyone can run again)."""
    ap = argparse.ArgumentParser(prog=ROUND_COMMAND, description="Fine-tune the minisci_tips prior (or --start) on "
                                 "examples from episodes it plays itself.")
    ap.add_argument("--iterations", type=int, default=1)
    ap.add_argument("--learn", choices=("tips", "actions", "both", "none"), default="tips",
                    help="what its own episodes teach: the tips it writes, its actions under a locating tip, both, or "
                         "nothing (no self-play: --decisions or --foreign examples only)")
    ap.add_argument("--foreign", nargs="+", choices=("house", "category", "task"), default=[],
                    help="also learn to act as without tips under another house's or another task's tips, or "
                         "another house's whose thing the task's category does not admit (see reader_examples)")
    ap.add_argument("--distill", action="store_true",
                    help="under --foreign tips, learn the tip-free prompt's whole next-token distribution along the "
                         "sampled action (KL to the tip-free policy) rather than the sampled action alone")
    ap.add_argument("--contrast", action="store_true",
                    help="with --learn actions (or both) and signed tips: each state labelled under the instance's "
                         "own tips also gets its twin under another house's tips, labelled as under --foreign")
    ap.add_argument("--decisions", type=int, default=0, metavar="HOUSES",
                    help="house draws per dev variation whose decision states each round trains at (signed tips)")
    ap.add_argument("--decision-families", nargs="+", default=None,
                    help="families of the decision states (default: every in-distribution family)")
    ap.add_argument("--foreign-per-state", type=int, default=2,
                    help="sets of another house's tips per decision state (each a SOFT example)")
    ap.add_argument("--resign", action="store_true",
                    help="at decision states, the instance's own tips re-signed with another house's signature in "
                         "place of that house's tips: the signature the only difference")
    ap.add_argument("--match-weight", type=float, default=0.0,
                    help="with --decisions: also train a linear head on the last hidden layer to tell whether each "
                         "signature field, and the whole signature, is the instance's own (signature_match_loss on "
                         "re-signed pairs of the decision states, one batch of 8 per step, this weight); the head "
                         "starts from --start's match_head.pt when it has one and is saved beside the checkpoint")
    ap.add_argument("--replay-kinds", nargs="+", choices=KINDS, default=list(KINDS),
                    help="kinds of stage-1 sequence mixed in (MISLED teaches searching after a tip proved wrong, the "
                         "opposite of what --foreign teaches after another house's tip proved wrong)")
    ap.add_argument("--setting", nargs="+", default=[], metavar="KEY=VALUE",
                    help="TipPriorSettings fields (numbers; booleans as 0 or 1) of the stage-1 prior and of the "
                         "sequences mixed in, e.g. irrelevant_rate=1 tip_signature=1; with --start, tip_signature "
                         "defaults to the checkpoint's")
    ap.add_argument("--episodes", type=int, default=3, help="episodes per dev instance, one after another")
    ap.add_argument("--replay", type=float, default=1.0, help="stage-1 sequences mixed in per self-played one")
    ap.add_argument("--epochs", type=float, default=3.0, help="over the examples of each fine-tuning round")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", default=None, help="continue from this checkpoint (an earlier round's --out) instead "
                                                  "of the stage-1 prior; its self-play examples are not carried over")
    ap.add_argument("--out", required=True)
    return ap


def parse_round(argv: list[str]) -> argparse.Namespace:
    """`round_parser()`'s options, with every combination that cannot run refused in one line before any work."""
    ap = round_parser()
    args = ap.parse_args(argv)
    if args.distill and not (args.foreign or args.contrast):
        ap.error("--distill labels the states under --foreign tips or --contrast twins; give one of them too")
    if args.decisions < 0 or args.foreign_per_state < 0:
        ap.error("--decisions and --foreign-per-state count house draws and tip sets: give 0 or more")
    unknown = sorted(set(args.decision_families or []) - set(IN_DISTRIBUTION))
    if unknown:
        ap.error(f"--decision-families {' '.join(unknown)}: not an in-distribution family (one of "
                 f"{', '.join(IN_DISTRIBUTION)})")
    if args.match_weight < 0 or (args.match_weight and not args.decisions):
        ap.error("--match-weight asks for the signature at the --decisions states: give --decisions and a weight >= 0")
    if args.resign and not args.decisions:
        ap.error("--resign re-signs the tips of --decisions states; give --decisions too")
    if args.learn == "none" and not (args.decisions or args.foreign):
        ap.error("--learn none trains on --decisions or --foreign examples only; give one of them")
    if args.contrast and args.learn == "tips":
        ap.error("--contrast pairs the states of --learn actions (or both); give one of them")
    args.changes = _setting_changes(ap, args.setting)
    if args.start and "tip_signature" not in args.changes:  # its tips are labelled as the checkpoint learned them
        args.changes["tip_signature"] = tips_signed(args.start)
    if (args.contrast or args.decisions) and not args.changes.get("tip_signature", TipPriorSettings.tip_signature):
        ap.error("--contrast and --decisions need signed tips (tip_signature): without them a prompt under another "
                 "house's tips reads like one under its own")
    args.argv = list(argv)
    return args


def _setting_changes(ap: argparse.ArgumentParser, items: list[str]) -> dict:
    fields = {f.name: f.type for f in dataclasses.fields(TipPriorSettings)}
    changes = {}
    for item in items:
        key, _, value = item.partition("=")
        if key not in fields or fields[key] not in ("float", "int", "bool"):
            ap.error(f"--setting {item}: {key!r} is not a numeric or boolean TipPriorSettings field")
        try:
            if fields[key] == "bool":
                changes[key] = {"1": True, "true": True, "0": False, "false": False}[value.lower()]
            else:
                changes[key] = float(value) if fields[key] == "float" else int(value)
        except (KeyError, ValueError):
            ap.error(f"--setting {item}: {key} takes a {'0 or 1' if fields[key] == 'bool' else 'number'} "
                     f"({fields[key]})")
    return changes


def run_round(args: argparse.Namespace, log=print) -> Path:
    """One `parse_round` command: `--iterations` rounds of play, label and fine-tune from `--start` (or the stage-1
    prior with `--setting`, built first when it is not cached), written as a checkpoint to `--out` that records the
    command and what each round measured."""
    settings = dataclasses.replace(TipPriorSettings(), **args.changes)
    signature = settings.tip_signature
    if not args.start:
        ensure_minisci_tips(settings, log)
    path, model, tok, sequences = cached_prior(settings, args.start)
    scripted_seqs = [(ids, kinds) for kind, ids, kinds in sequences if kind in args.replay_kinds]
    torch.manual_seed(args.seed)
    head = torch.nn.Linear(model.config.hidden_size, 1)  # the match head (--match-weight); trained only with it
    if args.match_weight and args.start and (Path(args.start) / "match_head.pt").is_file():
        head.load_state_dict(torch.load(Path(args.start) / "match_head.pt"))
    rng = random.Random(args.seed)
    tuning = dataclasses.replace(settings, epochs=args.epochs, lr=args.lr, seed=args.seed)
    own, rounds = [], []
    for it in range(args.iterations):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(args.seed + it)
            played, auxiliary = {}, None
            if args.learn in ("tips", "both"):
                examples, played["tips"] = self_play_examples(model, tok, args.episodes, seed=args.seed + 1000 * it,
                                                                signature=signature)
                own += examples
            if args.learn in ("actions", "both"):
                examples, played["actions"] = reader_examples(model, tok, seed=args.seed + 1000 * it,
                                                              signature=signature, contrast=args.contrast,
                                                              distill=args.distill and args.contrast)
                own += examples
            if args.decisions:
                families = args.decision_families or IN_DISTRIBUTION
                states = decision_states([i for i in dev_instances(random.Random(args.seed + 1000 * it + 7),
                                                                   args.decisions) if i[0] in families],
                                         seed=args.seed + it)
                held = decision_states([i for i in dev_instances(random.Random(args.seed + 1000 * it + 8), 1)
                                        if i[0] in families], seed=args.seed + it + 1)
                trained = states[::max(1, len(states) // 300)]  # (every k-th: what it fits on its own states)
                played["decisions"] = {"states": len(states), "held_out_before": decision_shift(model, tok, held),
                                       "trained_before": decision_shift(model, tok, trained)}
                log(f"decision states: {len(states)}; held-out shift before: {played['decisions']}")
                own += decision_examples(model, tok, states, args.foreign_per_state, seed=args.seed + it,
                                          resigned=args.resign)
                if args.match_weight:
                    held_match = signature_match_examples(tok, held, seed=args.seed + it)
                    played["decisions"]["match_held_out_before"] = signature_match_accuracy(model, head, held_match)
                    batches = signature_match_batches(tok, states, seed=args.seed + it)

                    def auxiliary(batches=batches):
                        return args.match_weight * signature_match_loss(model, head, next(batches))
            for kind in args.foreign:
                examples, played[f"foreign_{kind}"] = reader_examples(model, tok, seed=args.seed + 1000 * it,
                                                                      foreign=kind, signature=signature,
                                                                      distill=args.distill)
                own += examples
            mix = own + rng.sample(scripted_seqs, min(len(scripted_seqs), round(args.replay * len(own))))
            played["fine_tune"] = behaviour_clone(model, mix, tuning, tok.pad_token_id,
                                                  name=f"fine-tune {it + 1}/{args.iterations}", by_length=True,
                                                  lm_weight=settings.lm_weight, auxiliary=auxiliary,
                                                  auxiliary_params=list(head.parameters()) if auxiliary else ())
        if args.decisions:
            played["decisions"] |= {"held_out_after": decision_shift(model, tok, held),
                                    "trained_after": decision_shift(model, tok, trained)}
            if args.match_weight:
                played["decisions"]["match_held_out_after"] = signature_match_accuracy(model, head, held_match)
        rounds.append(played)
        log(json.dumps(played))
    out = Path(args.out)
    save_cached_checkpoint(model, tok, {"start": str(path), "command": f"{ROUND_COMMAND} {shlex.join(args.argv)}",
                                        "self_play": rounds, "prompt_layout": MINISCI_TIPS_LAYOUT,
                                        "tip_signature": signature}, out)
    if args.match_weight:
        torch.save(head.state_dict(), out / "match_head.pt")
    return out


SHIPPED_BY_ROUNDS = ("minisci_tips_reader", "minisci_tips_signed")  # the shipped priors made by rounds
# the priors built with their default settings into the cache, where `model=minisci_bc|minisci_tips` loads them
STAGE_ONE = {"minisci_bc": ensure_minisci_bc, "minisci_tips": ensure_minisci_tips}


def recorded_rounds(name: str) -> list[list[str]]:
    """The round commands (argument lists) the shipped prior `name`'s `empo2_source.json` records, in order: its
    `chain` of commands (the stage-1 build among them is implied by the rounds' --setting), else its one command."""
    source = json.loads((shipped_prior(name) / "empo2_source.json").read_text())
    commands = source.get("chain", [source["command"]])
    rounds = []
    for command in commands:
        words = shlex.split(command.split("  #")[0])
        if len(words) > 2 and words[1].endswith("self_play_probe.py"):  # the rounds' entry point when they ran
            rounds.append(words[2:])
    return rounds


def planned_rounds(name: str, out: Path) -> list[list[str]]:
    """The recorded rounds of the shipped prior `name` as commands that write under `out`: each round's --out
    becomes a folder of `out` and the next round's --start follows it."""
    if name not in SHIPPED_BY_ROUNDS:
        raise SystemExit(f"{name}: not a prior built by rounds (one of {', '.join(SHIPPED_BY_ROUNDS)})")
    where: dict[str, str] = {}
    plan = []
    for argv in recorded_rounds(name):
        argv = list(argv)
        for flag in ("--start", "--out"):
            if flag in argv:
                i = argv.index(flag) + 1
                argv[i] = where.setdefault(argv[i], str(out / Path(argv[i]).name))
        plan.append(argv)
    return plan


def build_shipped(name: str, out: Path, log=print) -> Path:
    """Rebuild the shipped prior `name` under `out` from its recorded rounds (`planned_rounds`, the stage-1 prior
    built first when it is not cached). Returns the last round's folder: the prior."""
    plan = [parse_round(argv) for argv in planned_rounds(name, out)]  # every command checked before any work
    for args in plan:
        log(f"{ROUND_COMMAND} {shlex.join(args.argv)}")
        last = run_round(args, log)
    return last


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["round"]:
        print(f"wrote {run_round(parse_round(argv[1:]))}")
    elif argv[:1] == ["build"] and len(argv) == 2 and argv[1] in STAGE_ONE:
        print(f"wrote {STAGE_ONE[argv[1]]()}")
    elif argv[:1] == ["build"] and len(argv) == 4 and argv[2] == "--out":
        print(f"wrote {build_shipped(argv[1], Path(argv[3]))}")
    else:
        raise SystemExit(f"usage: {RECIPE_BUILD} {{{','.join(STAGE_ONE)}}}   (into the cache `model=` loads from)\n"
                         f"       {RECIPE_BUILD} {{{','.join(SHIPPED_BY_ROUNDS)}}} --out DIR\n"
                         f"       {ROUND_COMMAND} [options] --out DIR   (--help for the options)")


if __name__ == "__main__":
    torch.set_num_threads(2)
    quiet_libraries()
    main()

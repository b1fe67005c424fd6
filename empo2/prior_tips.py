"""`minisci-tips`: a CPU policy with the three abilities EMPO²'s memory relies on in an instruct LLM.

`minisci-bc` (empo2/prior.py) only acts; it never saw a tip and never learned to write one, so with it
the memory half of EMPO² is inert. This preset is the same 0.7M-parameter model trained, on MiniSci
*dev* variations only (never the variations RL trains, validates or tests on), with the collector's own
`PromptBuilder`, to

- act from the tip-free prompt: the gold action of each step. The gold path goes straight to rooms the
  prompt gives no clue about, so the policy learns the action grammar and the usual order of a task but
  has to guess where things are, and, like an LLM's prior, keeps falling for the look-alikes;
- act on tips in its prompt, formatted exactly as the collector formats retrieved tips: hindsight tips of
  the instance's own episodes (exploration episodes often saw what the gold path needs), another family's
  tips (`irrelevant_rate`), or, in a misled episode, a tip that puts a sought thing in a wrong room, which
  the policy follows and then recovers from: it learns to use what a tip says rather than to obey any tip;
- answer the tip request (the whole episode chat plus the request turn) with a one-line hindsight tip
  stating what the episode revealed: where the things the house hides were seen, which focus failed, and
  the final score. The labels are written at build time from the episode as it was played; at run time
  the tips come from the policy alone, never from the environment's hidden state.

Exploration episodes are played by a scripted explorer: a walk through the house that prefers rooms
it has not seen, ending on a `focus on` a visible thing (often a look-alike, as a prior-driven agent
would); only their tips are learned, not their actions.

Two choices make reading learnable within a CPU build. The prompt layout is the released code's (the whole
chat, each turn keeping its tips: `rollout=whole_chat`), so every step's prompt is a prefix of the episode chat
and one sequence trains all its actions and its tip, about seven times fewer tokens than one prompt per
step. And the loss also predicts the context tokens (`lm_weight`), the dense next-token signal an LLM gets
from pretraining, from which copying what the context says (a room a tip names, a door an observation
lists) is learned; with only the actions as targets, three CPU builds learned the grammar and never read.

Built on first use (deterministic for a seed), written atomically and cached under
`$EMPO2_CACHE/models/minisci-tips-<hash>`, as `minisci-bc` is.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from empo2.prior import CONTEXT, IGNORED, TARGET, BCSettings, behaviour_clone, dev_instances, ensure_cached

# Kinds of training sequence (one whole episode each).
TIP_FREE, WITH_TIPS, MISLED, EXPLORER = "tip_free", "with_tips", "misled", "explorer"
KINDS = (TIP_FREE, WITH_TIPS, MISLED, EXPLORER)
# The prompt layout the prior is trained on, and so runs with (conf/rollout/whole_chat.yaml, which
# `model=minisci_tips` selects): the whole chat, each turn keeping the tips its prompt carried (the released
# code's layout), within one budget that holds a 10-step episode with tips.
MAX_PROMPT_TOKENS = 2048


@dataclass(frozen=True)
class TipPriorSettings(BCSettings):
    """Everything the cached model depends on (its hash names the cache folder)."""

    houses_per_variation: int = 4  # each dev variation in this many houses: where things are varies, tips tell
    explorers_per_house: int = 2  # exploration episodes per (instance, house): the tips' sources
    explorer_steps: tuple[int, int] = (2, 7)  # walk length range before the closing focus
    tips_per_prompt: tuple[int, int] = (1, 3)
    irrelevant_rate: float = 0.2  # share of gold-step tip blocks whose tips come from another family
    misled_rate: float = 0.5  # chance per (instance, house) of a misled episode (a wrong tip, followed)
    lm_weight: float = 0.3  # weight of the context tokens' next-token loss (targets weigh 1)
    batch_size: int = 12  # whole episodes of ~1,000 tokens
    epochs: float = 5.5
    version: int = 4


@dataclass
class Episode:
    """One played episode of a dev instance, with what a hindsight tip may say about it."""

    family: str
    variation: int
    house: dict
    task: str
    turns: list[tuple[str, str]]  # (observation, action)
    final_obs: str
    sightings: dict[str, str]  # sought thing -> room where the episode first saw it (where it lay)
    visited: list[str]  # rooms in the order first entered
    failed_focus: str | None
    score: int


def hindsight_tip(ep: Episode) -> str:
    """The one-line tip an episode supports: where it saw what the house hides, the focus that failed, the
    score; only what its own observations showed."""
    seen = ", ".join(f"{thing} in the {room}" for thing, room in sorted(ep.sightings.items()))
    parts = [f"Seen: {seen}." if seen else "Seen: nothing the task needs."]
    if ep.failed_focus:
        parts.append(f"Focusing on the {ep.failed_focus} failed.")
    parts.append(f"Final score {ep.score}.")
    return " ".join(parts)


def _record(env, ep: Episode) -> None:
    """Sightings and visits after a step: build-time bookkeeping from the env's state, never a prompt."""
    world, task = env._world, env._task
    if world.location not in ep.visited:
        ep.visited.append(world.location)
    for thing in task.sought:
        if thing not in ep.sightings and world.visible(thing):
            room = world.room_of(thing)
            ep.sightings[thing] = world.location if room == "inventory" else room


def play(env, family: str, variation: int, house: dict, actions) -> Episode:
    """Play `actions` (a list, or a callable (env, step) -> action or None to stop) from a reset."""
    obs, info = env.reset(task=family, variation=variation)
    ep = Episode(family, variation, house, info["task_description"], [], obs, {}, [], None, 0)
    _record(env, ep)
    step, score = 0, 0
    while True:
        action = actions(env, step) if callable(actions) else (actions[step] if step < len(actions) else None)
        if action is None:
            break
        result = env.step(action)
        ep.turns.append((obs, action))
        obs = result.obs
        _record(env, ep)
        step += 1
        score = int(result.info["score"])
        if result.info["failed"]:
            ep.failed_focus = action.removeprefix("focus on ").strip()
        if result.done:
            break
    ep.final_obs, ep.score = obs, score
    return ep


def explorer(rng: random.Random, steps: int):
    """A prior-driven walk: unseen rooms first, then a `focus on` a visible thing (often a look-alike)."""
    seen: set[str] = set()

    def act(env, step: int) -> str | None:
        world = env._world
        seen.add(world.location)
        valid = env.valid_actions()
        if step < steps:
            moves = [a for a in valid if a.startswith("go to ")]
            fresh = [a for a in moves if a.removeprefix("go to ") not in seen]
            if moves:
                return rng.choice(fresh or moves)
        if step == steps:
            focus = [a for a in valid if a.startswith("focus on ")]
            return rng.choice(focus) if focus else None
        return None

    return act


def misled(room: str):
    """A tip reader told that what it seeks is in `room`: it goes there first and, not finding it there,
    follows the gold plan from where it stands (what trusting a wrong tip costs, and how to recover)."""
    from empo2.envs.minisci.layout import Planner

    actions: list[str] = []

    def act(env, step: int) -> str | None:
        if step == 0:
            plan = Planner(env._world)
            plan.go(room)
            actions.extend(plan.actions)
        if step == len(actions):  # arrived: plan the rest on the world as it now is
            actions.extend(env._task.gold(env._world))
        return actions[step] if step < len(actions) else None

    return act


@dataclass
class Instance:
    """One dev instance in one house: its gold episode, exploration episodes and (maybe) a misled one."""

    gold: Episode
    explorers: list[Episode]
    misled: Episode | None = None
    wrong_tip: str | None = None  # the tip that misled it: the gold tip with a sought thing moved

    @property
    def episodes(self) -> list[Episode]:
        return [self.gold, *self.explorers, *([self.misled] if self.misled else [])]


def dev_episodes(settings: TipPriorSettings) -> list[Instance]:
    """Gold, exploration and misled episodes of every in-distribution dev instance and house draw."""
    from empo2.envs import make_env
    from empo2.envs.minisci.layout import HUB

    rng = random.Random(settings.seed)
    out = []
    for family, variation, house in dev_instances(rng, settings.houses_per_variation):
        env = make_env("minisci", max_steps=100, **house)
        env.reset(task=family, variation=variation)
        gold = play(env, family, variation, house, env.gold_actions())
        if gold.score != 100:
            raise RuntimeError(f"the gold path of {family}/{variation} in house {house} does not win")
        explorers = [play(env, family, variation, house, explorer(rng, rng.randint(*settings.explorer_steps)))
                     for _ in range(settings.explorers_per_house)]
        inst = Instance(gold, explorers)
        if rng.random() < settings.misled_rate:
            thing = rng.choice(sorted(gold.sightings))
            rooms = sorted(set(env._world.rooms) - {gold.sightings[thing], HUB})
            room = rng.choice(rooms)
            inst.misled = play(env, family, variation, house, misled(room))
            if inst.misled.score != 100:
                raise RuntimeError(f"the misled path of {family}/{variation} in house {house} does not win")
            tip = hindsight_tip(gold)
            inst.wrong_tip = tip.replace(f"{thing} in the {gold.sightings[thing]}", f"{thing} in the {room}")
        out.append(inst)
    return out


def episode_sequence(builder, ep: Episode, tips: list[str] | None, act: int) -> tuple[list[int], list[int]]:
    """(ids, kinds) of one whole episode as the collector shows it with `tips` in every turn: the tip request
    chat, then the hindsight tip as a TARGET. Each step's prompt is a prefix of this chat, so one sequence trains
    every action (kind `act`: TARGET, or IGNORED for actions that should not be imitated) and the tip at once;
    the prefix property is checked, not assumed."""
    tok = builder.tokenizer

    def target(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]

    history_tips = [tips] * len(ep.turns) if tips else None
    chat = builder.build_tip_request(ep.task, ep.turns, ep.final_obs, history_tips=history_tips)
    kinds = [CONTEXT] * len(chat)
    for t, (obs, action) in enumerate(ep.turns):
        prompt = builder.build(ep.task, ep.turns[:t], obs, tips, history_tips[:t] if tips else None).ids
        ids = target(action)
        if chat[:len(prompt)] != prompt or chat[len(prompt):len(prompt) + len(ids)] != ids:
            raise RuntimeError("a step's prompt is not a prefix of the episode chat: this chat template or prompt "
                               "budget cannot train a whole episode in one sequence")
        kinds[len(prompt):len(prompt) + len(ids)] = [act] * len(ids)
    tip = target(hindsight_tip(ep))
    return chat + tip, kinds + [TARGET] * len(tip)


def training_sequences(builder, data: list[Instance],
                       settings: TipPriorSettings) -> list[tuple[str, list[int], list[int]]]:
    """(kind, ids, kinds) per training sequence, all from `builder`: per instance the gold episode tip-free
    (TIP_FREE) and with tips (WITH_TIPS), the misled episode with its wrong tip (MISLED), and the exploration
    episodes tip-free with their actions IGNORED (EXPLORER: only their hindsight tips are learned).

    Acting with tips is labelled with what a reader of those tips does: the gold path under the instance's own
    (true) tips or another family's tips (nothing to use), the misled path under a tip that puts a sought thing
    in the wrong room, so the action follows what the tip says and no label contradicts it.
    """
    rng = random.Random(settings.seed + 1)
    tips_by_family: dict[str, list[str]] = {}
    for inst in data:
        tips_by_family.setdefault(inst.gold.family, []).extend(hindsight_tip(e) for e in inst.episodes)
    out = []
    for inst in data:
        gold = inst.gold
        own = [hindsight_tip(e) for e in (gold, *inst.explorers)]
        foreign = [t for f, tips in tips_by_family.items() if f != gold.family for t in tips]
        pool = foreign if foreign and rng.random() < settings.irrelevant_rate else own
        tips = rng.sample(pool, min(rng.randint(*settings.tips_per_prompt), len(pool)))
        out.append((TIP_FREE, *episode_sequence(builder, gold, None, TARGET)))
        out.append((WITH_TIPS, *episode_sequence(builder, gold, tips, TARGET)))
        if inst.misled:
            out.append((MISLED, *episode_sequence(builder, inst.misled, [inst.wrong_tip], TARGET)))
        out += [(EXPLORER, *episode_sequence(builder, e, None, IGNORED)) for e in inst.explorers]
    return out


def prompt_builder(tok):
    """The PromptBuilder of the layout this prior is trained on and runs with."""
    from empo2.rollout.prompts import PromptBuilder

    return PromptBuilder(tok, max_prompt_tokens=MAX_PROMPT_TOKENS, history_turns=None,
                         max_request_tokens=MAX_PROMPT_TOKENS)


def build_minisci_tips(settings: TipPriorSettings, log=print):
    """Tokenizer and trained model, from scratch."""
    from empo2.memory.tips import TIP_HEADER, tip_request_message
    from empo2.models import build_bpe_tokenizer, build_tiny_model
    from empo2.rollout.prompts import DEFAULT_SYSTEM_PROMPT

    data = dev_episodes(settings)
    episodes = [e for inst in data for e in inst.episodes]
    corpus = [DEFAULT_SYSTEM_PROMPT, tip_request_message()["content"], TIP_HEADER]
    corpus += [e.task for e in episodes] + [hindsight_tip(e) for e in episodes]
    corpus += [inst.wrong_tip for inst in data if inst.wrong_tip]
    corpus += [text for e in episodes for pair in e.turns for text in pair]
    tok = build_bpe_tokenizer(corpus, settings.vocab_size)
    sequences = training_sequences(prompt_builder(tok), data, settings)
    model = build_tiny_model(tok, settings.seed, hidden_size=settings.hidden_size, num_layers=settings.num_layers,
                             num_heads=settings.num_heads)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        stats = behaviour_clone(model, [(ids, kinds) for _, ids, kinds in sequences], settings, tok.pad_token_id,
                                log, name="minisci-tips", by_length=True, lm_weight=settings.lm_weight)
    stats["episodes"] = len(episodes)
    stats["sequences_by_kind"] = {k: sum(s[0] == k for s in sequences) for k in KINDS}
    stats["tokens"] = sum(len(ids) for _, ids, _ in sequences)
    stats["parameters"] = sum(p.numel() for p in model.parameters())
    return model, tok, stats


def ensure_minisci_tips(settings: TipPriorSettings | None = None, log=print):
    """Path of the cached model, building it on first use."""
    return ensure_cached("minisci-tips", settings or TipPriorSettings(), build_minisci_tips, log)

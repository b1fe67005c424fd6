"""`minisci-tips`: a CPU policy with the three abilities EMPO²'s memory relies on in an instruct LLM.

`minisci-bc` (empo2/prior.py) only acts; it never saw a tip and never learned to write one, so with it
the memory half of EMPO² is inert. This preset is the same 0.7M-parameter model trained, on MiniSci
*dev* variations only (never the variations RL trains, validates or tests on), with the collector's own
`PromptBuilder`, on three kinds of examples:

- act from the tip-free prompt: the gold action of each step. The gold path goes straight to rooms the
  prompt gives no clue about, so the clone learns the action grammar and the usual order of a task but
  has to guess where things are, and, like an LLM's prior, keeps falling for the look-alikes;
- act on a tip block: the same gold steps with tips in the current turn, formatted exactly as the
  collector formats retrieved tips. The tips are hindsight tips of *other* episodes of the same
  instance (exploration episodes, which often saw what the gold path needs), mixed with irrelevant
  tips (from other instances) and wrong ones (a key thing moved to another room) at `irrelevant_rate`
  and `wrong_rate`: the clone learns to use what a tip says rather than to obey any tip;
- answer the tip request (the whole episode chat plus the request turn) with a one-line hindsight tip
  stating what the episode revealed: which task-relevant things were seen in which room, the rooms
  visited, which focus failed, and the final score. The labels are written at build time from the
  episode as it was played; at run time the tips come from the policy alone, never from the
  environment's hidden state.

Exploration episodes are played by a scripted explorer: a walk through the house that prefers rooms
it has not seen, ending on a `focus on` a visible thing (often a look-alike, as a prior-driven agent
would).

Built on first use (deterministic for a seed), written atomically and cached under
`$EMPO2_CACHE/models/minisci-tips-<hash>`, as `minisci-bc` is.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from empo2.prior import (
    HISTORY_TURNS,
    MAX_PROMPT_TOKENS,
    MAX_REQUEST_TOKENS,
    BCSettings,
    behaviour_clone,
    dev_instances,
    ensure_cached,
)

TIP_FREE, WITH_TIPS, TIP_REQUEST = "act", "act_with_tips", "tip_request"


@dataclass(frozen=True)
class TipPriorSettings(BCSettings):
    """Everything the cached model depends on (its hash names the cache folder)."""

    houses_per_variation: int = 2
    explorers_per_house: int = 2  # exploration episodes per (instance, house): the tips' sources
    explorer_steps: tuple[int, int] = (2, 7)  # walk length range before the closing focus
    tips_per_prompt: tuple[int, int] = (1, 3)
    irrelevant_rate: float = 0.2  # share of gold-step tip blocks whose tips come from another family
    misled_rate: float = 0.5  # chance per (instance, house) of a misled episode (a wrong tip, followed)
    request_repeats: int = 2  # each tip request counts this many times per epoch (its one line is the hardest)
    epochs: float = 2.5
    version: int = 3


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


def tip_examples(builder, data: list[Instance], settings: TipPriorSettings) -> list[tuple[str, list[int], list[int]]]:
    """(kind, prompt ids, target ids + end of turn) for the three abilities, all from `builder`.

    Acting with tips is labelled with what a reader of those tips does: on the gold path when the tips are
    the instance's own (true) or another family's (nothing to use), and on the misled path when a tip puts
    a sought thing in the wrong room, so the action follows what the tip says and no label contradicts it.
    """
    rng = random.Random(settings.seed + 1)
    tok = builder.tokenizer
    eos = tok.eos_token_id

    def target(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False) + [eos]

    tips_by_family: dict[str, list[str]] = {}
    for inst in data:
        tips_by_family.setdefault(inst.gold.family, []).extend(hindsight_tip(e) for e in inst.episodes)
    examples = []
    for inst in data:
        gold = inst.gold
        own = [hindsight_tip(e) for e in (gold, *inst.explorers)]
        foreign = [t for f, tips in tips_by_family.items() if f != gold.family for t in tips]
        for t, (obs, action) in enumerate(gold.turns):
            history = gold.turns[:t]
            examples.append((TIP_FREE, builder.build(gold.task, history, obs).ids, target(action)))
            k = rng.randint(*settings.tips_per_prompt)
            pool = foreign if foreign and rng.random() < settings.irrelevant_rate else own
            tips = rng.sample(pool, min(k, len(pool)))
            examples.append((WITH_TIPS, builder.build(gold.task, history, obs, tips).ids, target(action)))
        if inst.misled:
            for t, (obs, action) in enumerate(inst.misled.turns):
                prompt = builder.build(gold.task, inst.misled.turns[:t], obs, [inst.wrong_tip])
                examples.append((WITH_TIPS, prompt.ids, target(action)))
        for ep in inst.episodes:
            request = builder.build_tip_request(ep.task, ep.turns, ep.final_obs)
            examples += [(TIP_REQUEST, request, target(hindsight_tip(ep)))] * settings.request_repeats
    return examples


def build_minisci_tips(settings: TipPriorSettings, log=print):
    """Tokenizer and trained model, from scratch."""
    from empo2.memory.tips import TIP_HEADER, tip_request_message
    from empo2.models import build_bpe_tokenizer, build_tiny_model
    from empo2.rollout.prompts import DEFAULT_SYSTEM_PROMPT, PromptBuilder

    data = dev_episodes(settings)
    episodes = [e for inst in data for e in inst.episodes]
    corpus = [DEFAULT_SYSTEM_PROMPT, tip_request_message()["content"], TIP_HEADER]
    corpus += [e.task for e in episodes] + [hindsight_tip(e) for e in episodes]
    corpus += [inst.wrong_tip for inst in data if inst.wrong_tip]
    corpus += [text for e in episodes for pair in e.turns for text in pair]
    tok = build_bpe_tokenizer(corpus, settings.vocab_size)
    builder = PromptBuilder(tok, max_prompt_tokens=MAX_PROMPT_TOKENS, history_turns=HISTORY_TURNS,
                            max_request_tokens=MAX_REQUEST_TOKENS)
    examples = tip_examples(builder, data, settings)
    model = build_tiny_model(tok, settings.seed, hidden_size=settings.hidden_size, num_layers=settings.num_layers,
                             num_heads=settings.num_heads)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        stats = behaviour_clone(model, [(p, a) for _, p, a in examples], settings, tok.pad_token_id, log,
                                name="minisci-tips", by_length=True)
    stats["episodes"] = len(episodes)
    stats["examples_by_kind"] = {k: sum(e[0] == k for e in examples) for k in (TIP_FREE, WITH_TIPS, TIP_REQUEST)}
    stats["parameters"] = sum(p.numel() for p in model.parameters())
    return model, tok, stats


def ensure_minisci_tips(settings: TipPriorSettings | None = None, log=print):
    """Path of the cached model, building it on first use."""
    return ensure_cached("minisci-tips", settings or TipPriorSettings(), build_minisci_tips, log)

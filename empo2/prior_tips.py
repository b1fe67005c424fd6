"""`minisci-tips`: a CPU policy with the three abilities EMPO²'s memory relies on in an instruct LLM.

`minisci-bc` (empo2/prior.py) only acts; it never saw a tip and never learned to write one, so with it
the memory half of EMPO² is inert. This preset is the same 0.7M-parameter model trained, on MiniSci
*dev* variations only (never the variations RL trains, validates or tests on), with the collector's own
`PromptBuilder`, to

- act from the tip-free prompt as a prior-driven agent does: head for the room its prior points to and,
  `trap_rate` of the time, focus on the look-alike waiting there (the trap every MiniSci family sets), else
  search the house carefully;
- act on tips in its prompt, formatted exactly as the collector formats retrieved tips: the instance's own
  hindsight tips (one saying where the needed things are: the gold path; one saying only which look-alike
  failed: a careful search that avoids it), another family's tips (nothing to use: as without tips), or a tip
  that puts a sought thing in a wrong room (followed, then recovered from by searching): it learns to use what
  a tip says rather than to obey any tip;
- answer the tip request (the whole episode chat plus the request turn) with a one-line hindsight tip
  stating what the episode revealed: where the things the house hides were seen, which focus failed, and
  the final score. The labels are written at build time from the episode as it was played; at run time
  the tips come from the policy alone, never from the environment's hidden state.

The agents it imitates are scripted (`scripted`): they see the house only through the moves they make, except
that the gold path and the search's last leg are planned on the true house, as every label here is.

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

import bisect
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from empo2.model_io import build_bpe_tokenizer, build_tiny_model, load_local
from empo2.model_presets import MINISCI_TIPS_LAYOUT
from empo2.prior import (
    CONTEXT,
    IGNORED,
    SOFT,
    TARGET,
    BCSettings,
    behaviour_clone,
    dev_instances,
    ensure_cached,
    ready_path,
)

# Kinds of training sequence (one whole episode each; see `training_sequences`).
TIP_FREE, LOCATED, SEARCH, IRRELEVANT, MISLED = "tip_free", "located", "search", "irrelevant", "misled"
OTHER_VARIATION, OTHER_HOUSE = "other_variation", "other_house"
KINDS = (TIP_FREE, LOCATED, SEARCH, IRRELEVANT, MISLED, OTHER_VARIATION, OTHER_HOUSE)
# The prompt layout the prior is trained on, and so runs with (`empo2.model_presets.MINISCI_TIPS_LAYOUT`, recorded in
# every checkpoint built from it; conf/rollout/whole_chat.yaml, which `model=minisci_tips` selects): the whole
# chat, each turn keeping the tips its prompt carried (the released code's layout), within one budget that
# holds a 10-step episode with tips.
MAX_PROMPT_TOKENS = 2048


@dataclass(frozen=True)
class TipPriorSettings(BCSettings):
    """Everything the cached model depends on (its hash names the cache folder)."""

    houses_per_variation: int = 3  # each dev variation in this many houses: where things are varies, tips tell
    # How often the prior-driven (tip-free) agent takes the bait: heads for the room its prior points to and
    # focuses on the look-alike there. Higher makes the trap harder for RL alone to escape (fewer tip-free wins
    # to reinforce) and the memory's lesson starker; the rest of its episodes are careful searches.
    trap_rate: float = 0.75
    # Episodes end after this many steps, as they do at run time (the headline's env.max_steps), so the prior
    # writes tips about cut episodes as it will have to; a whole episode with 3 tips per turn fits the budget.
    max_turns: int = 10
    tips_per_prompt: tuple[int, int] = (1, 3)
    irrelevant_rate: float = 0.5  # chance per instance of an episode under another family's tips (ignored)
    misled_rate: float = 0.5  # chance per instance of an episode under a wrong tip (followed, then recovered)
    # Chance per instance of a prior-driven episode under tips of another variation of its family, none of which
    # names a thing of this task (so nothing in them applies, though they read like its own). 0 in builds up to 5,
    # where every kind with tips but IRRELEVANT avoids the trap, and a reader learns that a tip block, whatever
    # it says, switches the trap off (reports/minisci_priors, "A tip works on this reader by being there"); with
    # it and `irrelevant_rate` at 1 about as many episodes are under tips that do not apply as avoid the trap for
    # what a tip says (reports/minisci_priors, "Labelling with the scripted prior-driven agent").
    other_variation_rate: float = 0.0
    # Every hindsight tip opens with the words of its task that tell its instance from another of the family
    # (`Goal: red box, kitchen.`: `Task.signature`), so a reader can tell a tip of its own instance from one of
    # another house by comparing it with its task. Off in builds up to 6, whose tips carry no such words: there
    # a tip about another house of the family says what a true tip says (a thing of the task's category, a room,
    # a won episode) and cannot be told apart before the house is searched (reports/minisci_priors, "Labelling
    # only tips it can tell apart"). Costs ~8 tokens per tip.
    tip_signature: bool = False
    # Chance per instance of a prior-driven episode under 1-3 tips of another variation of its family, whatever
    # they name (another house's tips, read as a reader sees them when tips are pooled per task). Needs
    # `tip_signature`: without it these labels contradict the gold path's under a true tip on prompts that
    # cannot be told apart. 0 in builds up to 6.
    other_house_rate: float = 0.0
    lm_weight: float = 0.3  # weight of the context tokens' next-token loss (targets weigh 1)
    batch_size: int = 12  # whole episodes of ~1,000 tokens
    epochs: float = 5.0
    version: int = 5


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
    signature: str = ""  # the words of its task that tell the instance from another of its family


SIGNATURE_HEAD = "Goal: "  # a signed tip opens with it, then its task's signature and a full stop


def hindsight_tip(ep: Episode, signature: bool = False) -> str:
    """The one-line tip an episode supports: where it saw what the house hides, the focus that failed, the
    score; only what its own observations showed. With `signature`, it opens with the words of its task that
    tell its instance from another of the family (`TipPriorSettings.tip_signature`)."""
    seen = ", ".join(f"{thing} in the {room}" for thing, room in sorted(ep.sightings.items()))
    parts = [f"{SIGNATURE_HEAD}{ep.signature}."] if signature else []
    parts.append(f"Seen: {seen}." if seen else "Seen: nothing the task needs.")
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


def play(env, family: str, variation: int, house: dict, actions, max_turns: int = 100,
         must_win: bool = False) -> Episode:
    """Play `actions` (a list, or a callable (env, step) -> action or None to stop) from a reset, for at most
    `max_turns` steps; with `must_win`, an episode that ends before the cap without winning is an error (a
    planner bug would teach the prior a losing path)."""
    obs, info = env.reset(task=family, variation=variation)
    ep = Episode(family, variation, house, info["task_description"], [], obs, {}, [], None, 0, env._task.signature)
    _record(env, ep)
    step, score = 0, 0
    while step < max_turns:
        action = actions(env, step) if callable(actions) else (actions[step] if step < len(actions) else None)
        if action is None:
            break
        result = env.step(action)
        ep.turns.append((obs, action))
        obs = result.obs
        _record(env, ep)
        step += 1
        score = int(result.info["score"])
        if result.info["failed"]:  # the action as the env resolved it (a policy's text may be loose)
            ep.failed_focus = (result.info["action"] or action).removeprefix("focus on ").strip()
        if result.done:
            break
    ep.final_obs, ep.score = obs, score
    if must_win and score != 100 and step < max_turns:
        raise RuntimeError(f"a scripted path of {family}/{variation} in house {house} does not win")
    return ep


def scripted(rng: random.Random, trap: bool = False, first_room: str | None = None):
    """A scripted agent. It walks to rooms it has not seen (first `first_room`, if given) until it has seen
    everything the task needs, then follows the gold plan from where it stands. With `trap` it is the
    prior-driven agent: it heads first for the room its prior points to, where the first look-alike waits, and
    focuses on any look-alike it sees (which ends the episode at score 0)."""
    from empo2.envs.minisci.layout import HUB, Planner

    plan: list[str] = []
    visited: set[str] = set()
    found: set[str] = set()
    planned = False

    def act(env, step: int) -> str | None:
        nonlocal planned
        world, task = env._world, env._task
        if plan:
            return plan.pop(0)
        if planned:
            return None
        if trap:
            tempting = [name for name in task.lookalikes if world.visible(name)]
            if tempting:
                return f"focus on {tempting[0]}"
        visited.add(world.location)
        found.update(thing for thing in task.sought if world.visible(thing))
        rooms = sorted(set(world.rooms) - visited - {HUB})
        head = first_room or (world.room_of(task.lookalikes[0]) if trap and task.lookalikes else None)
        if head in rooms:
            room = head
        elif found >= set(task.sought) or not rooms:
            planned = True
            plan.extend(task.gold(world))
            return plan.pop(0) if plan else None
        else:
            room = rng.choice(rooms)
        walk = Planner(world)
        walk.go(room)
        plan.extend(walk.actions)
        return plan.pop(0)

    return act


@dataclass
class Instance:
    """One dev instance in one house, as the agents the prior imitates play it."""

    gold: Episode  # the shortest winning path: what a reader does once its tips locate what the task needs
    habit: Episode  # the prior-driven agent, trapped with probability `trap_rate`: the tip-free behaviour
    search: Episode  # a careful agent that knows nothing yet: searches, takes no look-alike
    misled: Episode | None = None  # told a wrong room by `wrong_tip`: goes there first, then searches
    moved: tuple[str, str] | None = None  # (sought thing, wrong room) of `wrong_tip`

    @property
    def episodes(self) -> list[Episode]:
        return [self.gold, self.habit, self.search, *([self.misled] if self.misled else [])]

    def wrong_tip(self, signature: bool = False) -> str:
        """The gold path's tip with one sought thing moved to another room (`moved`): what the misled agent read."""
        thing, room = self.moved
        true = f"{thing} in the {self.gold.sightings[thing]}"
        return hindsight_tip(self.gold, signature).replace(true, f"{thing} in the {room}")


def locates(ep: Episode) -> bool:
    """Whether the episode's hindsight tip says where every thing the house hides is."""
    from empo2.envs.minisci.env import build
    from empo2.envs.minisci.layout import Difficulty

    return set(ep.sightings) >= set(build(ep.family, ep.variation, Difficulty(**ep.house))[1].sought)


def dev_episodes(settings: TipPriorSettings) -> list[Instance]:
    """The episodes of every in-distribution dev instance and house draw."""
    from empo2.envs import make_env
    from empo2.envs.minisci.layout import HUB

    rng = random.Random(settings.seed)
    out = []
    for family, variation, house in dev_instances(rng, settings.houses_per_variation):
        env = make_env("minisci", max_steps=100, **house)

        env.reset(task=family, variation=variation)
        key, cap = (family, variation, house), settings.max_turns
        gold = play(env, *key, env.gold_actions(), cap, must_win=True)
        habit = play(env, *key, scripted(rng, trap=rng.random() < settings.trap_rate), cap)
        inst = Instance(gold, habit, play(env, *key, scripted(rng), cap, must_win=True))
        if rng.random() < settings.misled_rate:
            thing = rng.choice(sorted(gold.sightings))
            room = rng.choice(sorted(set(env._world.rooms) - {gold.sightings[thing], HUB}))
            inst.misled = play(env, *key, scripted(rng, first_room=room), cap, must_win=True)
            inst.moved = thing, room
        out.append(inst)
    return out


def episode_sequence(builder, ep: Episode, tips: list[str] | None,
                     signature: bool = False) -> tuple[list[int], list[int]]:
    """(ids, kinds) of one whole episode as the collector shows it with `tips` in every turn: the tip request
    chat, then the hindsight tip, actions and tip as TARGETs. Each step's prompt is a prefix of this chat, so
    one sequence trains every action and the tip at once; the prefix property is checked, not assumed."""
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
        kinds[len(prompt):len(prompt) + len(ids)] = [TARGET] * len(ids)
    tip = target(hindsight_tip(ep, signature))
    return chat + tip, kinds + [TARGET] * len(tip)


def training_sequences(builder, data: list[Instance],
                       settings: TipPriorSettings) -> list[tuple[str, list[int], list[int]]]:
    """(kind, ids, kinds) per training sequence, all from `builder`. Per instance, each episode is labelled
    with the tips a reader of them would have acted on, so no label contradicts what its tips say:

    - TIP_FREE: the prior-driven episode, no tips;
    - LOCATED: the gold path, under 1-3 of the instance's own tips, one of which locates everything needed;
    - SEARCH: the careful search, under the tip of a prior-driven episode that located nothing (it names the
      look-alike whose focus failed, so a reader avoids it and searches);
    - IRRELEVANT (`irrelevant_rate`): the prior-driven episode again, under another family's tips, which say
      nothing about this house: a reader acts as without them;
    - MISLED (`misled_rate`): the path that trusts a wrong tip (goes to the room it names) and then searches;
    - OTHER_VARIATION (`other_variation_rate`): the prior-driven episode again, under 1-3 tips of one instance of
      another variation of the family that name nothing of this task (no sought thing, no look-alike);
    - OTHER_HOUSE (`other_house_rate`, with `tip_signature`): the prior-driven episode again, under 1-3 tips of
      one instance of another variation of the family, whatever they name: their signature is not its task's.
    """
    if settings.other_house_rate and not settings.tip_signature:
        raise ValueError("other_house_rate needs tip_signature: without it another house's tips read as its own, "
                         "and their labels contradict the gold path's")
    sig = settings.tip_signature
    rng = random.Random(settings.seed + 1)
    tips_by_family: dict[str, list[str]] = {}
    for inst in data:
        tips_by_family.setdefault(inst.gold.family, []).extend(hindsight_tip(e, sig) for e in inst.episodes)
    foreign_by_family = {family: [t for f, tips in sorted(tips_by_family.items()) if f != family for t in tips]
                         for family in tips_by_family}
    out = []
    for inst in data:
        family = inst.gold.family
        locating = [e for e in (inst.gold, inst.search) if locates(e)]
        own = [hindsight_tip(rng.choice(locating), sig)]
        others = sorted({hindsight_tip(e, sig) for e in (inst.gold, inst.habit, inst.search)} - {own[0]})
        own += rng.sample(others, min(rng.randint(*settings.tips_per_prompt) - 1, len(others)))
        rng.shuffle(own)
        out.append((TIP_FREE, *episode_sequence(builder, inst.habit, None, sig)))
        out.append((LOCATED, *episode_sequence(builder, inst.gold, own, sig)))
        if not locates(inst.habit):
            out.append((SEARCH, *episode_sequence(builder, inst.search, [hindsight_tip(inst.habit, sig)], sig)))
        foreign = foreign_by_family[family]
        if rng.random() < settings.irrelevant_rate and foreign:  # (a one-family subset of the data has none)
            tips = rng.sample(foreign, min(rng.randint(*settings.tips_per_prompt), len(foreign)))
            out.append((IRRELEVANT, *episode_sequence(builder, inst.habit, tips, sig)))
        if inst.misled:
            out.append((MISLED, *episode_sequence(builder, inst.misled, [inst.wrong_tip(sig)], sig)))
        if settings.other_variation_rate and rng.random() < settings.other_variation_rate:  # (no draw at 0: builds
            # up to 5 keep their sequences)
            tips = _other_variation_tips(inst, data, rng, settings.tips_per_prompt, sig)
            if tips:
                out.append((OTHER_VARIATION, *episode_sequence(builder, inst.habit, tips, sig)))
        if settings.other_house_rate and rng.random() < settings.other_house_rate:  # (no draw at 0, as above)
            tips = _other_variation_tips(inst, data, rng, settings.tips_per_prompt, sig, names_nothing=False)
            if tips:
                out.append((OTHER_HOUSE, *episode_sequence(builder, inst.habit, tips, sig)))
    return out


def _other_variation_tips(inst: Instance, data: list[Instance], rng: random.Random,
                          per_prompt: tuple[int, int], signature: bool, names_nothing: bool = True) -> list[str]:
    """`per_prompt` (1-3) hindsight tips of one instance of `inst`'s family and another variation; with
    `names_nothing` only those that name no thing of `inst`'s task (a variation's look-alike is another's sought
    thing: a tip naming it would apply here), else any, of an instance whose task's signature is not `inst`'s."""
    from empo2.envs.minisci.env import build
    from empo2.envs.minisci.layout import Difficulty

    g = inst.gold
    task = build(g.family, g.variation, Difficulty(**g.house))[1]
    names = (*task.sought, *task.lookalikes)
    donors = [d for d in data if d.gold.family == g.family and d.gold.variation != g.variation
              and (names_nothing or d.gold.signature != g.signature)]  # (a shared signature would read as its own)
    for donor in rng.sample(donors, min(3, len(donors))):  # the first with such tips, of three at most
        tips = sorted({t for t in (hindsight_tip(e, signature) for e in donor.episodes)
                       if not (names_nothing and any(n in t for n in names))})
        if tips:
            return rng.sample(tips, min(rng.randint(*per_prompt), len(tips)))
    return []


def prompt_builder(tok):
    """The PromptBuilder of the layout this prior is trained on and runs with."""
    from empo2.rollout.prompts import PromptBuilder

    return PromptBuilder(tok, max_prompt_tokens=MAX_PROMPT_TOKENS, history_turns=None,
                         max_request_tokens=MAX_PROMPT_TOKENS)


def build_minisci_tips(settings: TipPriorSettings, log=print):
    """Tokenizer and trained model, from scratch."""
    from empo2.memory.tips import TIP_HEADER, tip_request_message
    from empo2.rollout.prompts import DEFAULT_SYSTEM_PROMPT

    data = dev_episodes(settings)
    episodes = [e for inst in data for e in inst.episodes]
    corpus = [DEFAULT_SYSTEM_PROMPT, tip_request_message()["content"], TIP_HEADER]
    corpus += [e.task for e in episodes] + [hindsight_tip(e, settings.tip_signature) for e in episodes]
    corpus += [inst.wrong_tip(settings.tip_signature) for inst in data if inst.moved]
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
    return ensure_cached("minisci-tips", settings or TipPriorSettings(), build_minisci_tips, log,
                         source={"prompt_layout": MINISCI_TIPS_LAYOUT})


def tips_signed(path) -> bool:
    """Whether the checkpoint at `path` was trained on tips that open with their task's signature
    (`TipPriorSettings.tip_signature`, recorded in its `empo2_source.json` by a build or a probe): its own tips
    are then labelled, and scripted tips for it written, the same way."""
    source = Path(path) / "empo2_source.json"
    record = json.loads(source.read_text()) if source.is_file() else {}
    return bool(record.get("tip_signature", record.get("settings", {}).get("tip_signature", False)))


def cached_prior(settings: TipPriorSettings, start=None):
    """(path, model, tokenizer, training sequences) of the built prior, or of the checkpoint `start` (a fine-tune
    of it, with its tokenizer), with the prior's sequences, for a probe that continues training it (a probe never
    builds it: a run does)."""
    path = Path(start) if start else ready_path("minisci-tips", settings)
    if path is None:
        raise FileNotFoundError("no minisci-tips with the current settings: build it first (any run with "
                                "model=minisci_tips)")
    model, tok = load_local(path, torch.float32)
    return path, model, tok, training_sequences(prompt_builder(tok), dev_episodes(settings), settings)


# ------------------------------------------------------------------------------------- its own episodes
# The scripted episodes above teach the prior to write tips about *scripted* play, where what an episode did is
# also what its task and house predict (the prior-driven agent always takes the same look-alike), so a tip can
# be guessed without reading the episode. Its own episodes are not like that: it focuses on whichever look-alike
# it samples. `self_play_examples` gives tip-writing examples from episodes the prior plays itself, labelled
# with what those episodes showed (DAgger for the tip writer); benchmarks/minisci_tips_self_play_probe.py
# fine-tunes on them and reports/minisci_priors reports what that changes.

SELF_PLAY_CHUNK = 64  # instances played side by side (one generate call per step over all of them)


class _TipRequests:
    """The collector's engine, keeping the last batch of tip requests it was asked to complete: exactly the
    prompts the collector built from its own episode chats (tip requests are its only calls that do not stop at
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
    """The collector as calibration and RL run it (memory on, p = 1) and the dev instances it plays, one house draw
    each (one tip namespace per instance): the first `variations_per_family` of each family, or all; family by
    family, or with `shuffle` in an order drawn from `seed` (so that a chunk holds every family). Yields, per
    chunk of instances played side by side, (instances done, chunk, collector with the chunk's envs, replay envs
    of the same houses, task specs)."""
    from empo2.config import load_config
    from empo2.envs import make_env
    from empo2.envs.base import TaskSpec
    from empo2.rollout.build import build_collector, env_kwargs

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
    collector = build_collector(cfg, model, tok, 1)
    for start in range(0, len(instances), SELF_PLAY_CHUNK):
        chunk = instances[start:start + SELF_PLAY_CHUNK]
        collector.envs = [make_env("minisci", **{**env_kwargs(cfg), **house}) for _, _, house in chunk]
        replay_envs = [make_env("minisci", **{**env_kwargs(cfg), **house, "max_steps": 100}) for _, _, house in chunk]
        yield (start + len(chunk), len(instances)), chunk, collector, replay_envs, [TaskSpec(f, v) for f, v, _ in chunk]


def _actions(traj, tok) -> list[str]:
    """The texts a collector trajectory gave the env (Generation.text: the response up to its first newline)."""
    return [tok.decode(s.response_ids, skip_special_tokens=True).split("\n", 1)[0].strip() for s in traj.samples]


def replay(env, family: str, variation: int, house: dict, traj, tok, max_turns: int) -> Episode | None:
    """The episode a collector trajectory played, replayed in `env` (the same house) from the texts the policy
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
    for (done, total), chunk, collector, replay_envs, specs in _own_play(model, tok, max_turns,
                                                                         variations_per_family, seed):
        collector.engine = requests = _TipRequests(collector.engine)
        for r in range(episodes_per_instance):
            batch = collector.collect(specs, 1, iteration=r, generator=generator)
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
        collector.engine = requests.engine
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
    from empo2.envs.minisci.env import build
    from empo2.envs.minisci.layout import Difficulty

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


def contrast_twins(collector, env, family: str, variation: int, actions: list[str], tips: list[str]) -> list:
    """For `reader_examples(contrast=True)`: at each state the first len(actions) steps of an episode reach, the
    prompt the collector would build there with `tips` in every tip block (the same history, recorded as the
    collector records it: each action as the env parsed it), and its tip-free prompt: (prompt, None, tip-free)."""
    obs, info = env.reset(task=family, variation=variation)
    history: list[tuple[str, str]] = []
    in_history = collector.settings.tips_in_history
    twins = []
    for t, action in enumerate(actions):
        prompt = collector.builder.build(info["task_description"], history, obs, tips, [tips] * t if in_history
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
    probs) under tips that do not apply): each dev instance (`_own_play`) is played once through the collector
    with a memory holding scripted episodes' hindsight tips, keyed as the collector keys its own; every example is
    the collector's own prompt at a state its episode reached (IGNORED), then a label and end of turn (TARGET).
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
    from empo2.memory import TipMemory
    from empo2.rollout.engines.base import SamplingParams

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
    for (done, total), chunk, collector, replay_envs, specs in _own_play(model, tok, max_turns, variations_per_family,
                                                                         seed, shuffle=foreign == "task"):
        played, own_tips = [], []  # per instance: (tip, key text, score) of its scripted episodes; the gold set
        for (family, variation, house), env in zip(chunk, replay_envs):
            env.reset(task=family, variation=variation)
            gold = play(env, family, variation, house, env.gold_actions(), max_turns)
            others = [play(env, family, variation, house, scripted(rng, trap=trap), max_turns)
                      for trap in (True, False)]
            tips = [(hindsight_tip(ep, signature), collector._key_text(env, ep.turns, ep.final_obs), ep.score)
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
        like = collector.memory
        collector.memory = TipMemory(like.dim, **{k: v for k, v in like.config().items() if k != "dim"})
        collector.memory.add(texts, collector.embedder.encode(keys), metas)
        collector.settings.write_tips = False
        collector.settings.q = 1.0  # every step with tips also records its tip-free prompt (`train_ids`)
        batch = collector.collect(specs, 1, iteration=0, generator=generator)
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
                    pending += contrast_twins(collector, env, family, variation, actions[:len(labels)],
                                              [text for text, _, _ in twin_tips])
            else:
                pending += [(smp.behaviour_ids, a, smp.train_ids) for smp, a in zip(traj.samples, actions)
                            if smp.memory]
        if pending:  # the labels: one sample each from the tip-free prompts
            s = collector.settings
            params = SamplingParams(temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens)
            tip_free = [tip_free for _, _, tip_free in pending]
            gens = collector.engine.generate(tip_free, params, seed=collector._seed(generator))
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
    from empo2.envs import make_env

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
    """The collector's prompt at the state with `tips` in every turn's tip block (the whole-chat layout)."""
    return builder.build(state.task, state.turns, state.obs, tips, [tips] * len(state.turns) if tips else None).ids


def another_house(states: list[DecisionState], i: int, rng: random.Random) -> DecisionState | None:
    """A state of another instance of `states[i]`'s family whose task's signature differs (a shared signature
    would read as its own), or None."""
    me = states[i]
    others = [s for s in states if s.family == me.family and s.gold.signature != me.gold.signature]
    return rng.choice(others) if others else None


def decision_examples(model, tok, states: list[DecisionState], foreign_per_state: int = 2,
                      seed: int = 0, resigned: bool = False) -> list[tuple]:
    """Per decision state, examples whose prompts differ only in their tips, each the collector's prompt (CONTEXT,
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
    """What reading the signature computes, as a target of its own (benchmarks/minisci_signature_probe.py). Per
    decision state, the collector's prompt under the gold path's signed tip and under the same tip re-signed with
    another house's signature (`resign`), as (ids, positions, labels): at the last token of each field of the
    signature (the words between its commas: box and room, the component) in every tip block, 1.0 where that
    field is the instance's own; at the prompt's last token, where the reader answers, 1.0 where the whole
    signature is. The two prompts differ in the signature alone, so nothing else can tell them apart."""
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

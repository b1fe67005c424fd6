"""`minisci_tips`: a CPU policy with the three abilities EMPO²'s memory relies on in an instruct LLM.

`minisci_bc` (recipes/minisci_priors/prior.py) only acts; it never saw a tip and never learned to write one, so with it
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

Built by `python -m recipes.minisci_priors.prior_rounds build minisci_tips` or on a probe's first use (deterministic
for a seed), written atomically and cached under `$EMPO2_CACHE/models/minisci_tips-<hash>`, as `minisci_bc` is.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from empo2.config.presets import MINISCI_TIPS_LAYOUT
from empo2.envs import make_env
from empo2.envs.minisci.env import build
from empo2.envs.minisci.layout import HUB, Difficulty, Planner
from empo2.memory.tips import TIP_HEADER, tip_request_message
from empo2.models.io import build_bpe_tokenizer, build_tiny_model, load_local
from recipes.minisci_priors.prior import (
    CONTEXT,
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
# The prompt layout the prior is trained on, and so runs with (`empo2.config.presets.MINISCI_TIPS_LAYOUT`, recorded in
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

    return set(ep.sightings) >= set(build(ep.family, ep.variation, Difficulty(**ep.house))[1].sought)


def dev_episodes(settings: TipPriorSettings) -> list[Instance]:
    """The episodes of every in-distribution dev instance and house draw."""

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
    # imported here: `empo2.rollout` loads transformers, which `empo2 train` must not pay for before it has
    # checked the config and the machine (`models` imports this module)
    from empo2.rollout.prompts import PromptBuilder


    return PromptBuilder(tok, max_prompt_tokens=MAX_PROMPT_TOKENS, history_turns=None,
                         max_request_tokens=MAX_PROMPT_TOKENS)


def build_minisci_tips(settings: TipPriorSettings, log=print):
    """Tokenizer and trained model, from scratch."""
    from empo2.rollout.prompts import DEFAULT_SYSTEM_PROMPT  # imported here, as in `prompt_builder`

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
                                log, name="minisci_tips", by_length=True, lm_weight=settings.lm_weight)
    stats["episodes"] = len(episodes)
    stats["sequences_by_kind"] = {k: sum(s[0] == k for s in sequences) for k in KINDS}
    stats["tokens"] = sum(len(ids) for _, ids, _ in sequences)
    stats["parameters"] = sum(p.numel() for p in model.parameters())
    return model, tok, stats


def ensure_minisci_tips(settings: TipPriorSettings | None = None, log=print):
    """Path of the cached model, building it on first use."""
    return ensure_cached("minisci_tips", settings or TipPriorSettings(), build_minisci_tips, log,
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
    builds it: the recipe's build command does)."""
    path = Path(start) if start else ready_path("minisci_tips", settings)
    if path is None:
        raise FileNotFoundError("no minisci_tips with the current settings: build it first "
                                "(python -m recipes.minisci_priors.prior_rounds build minisci_tips)")
    model, tok = load_local(path, torch.float32)
    return path, model, tok, training_sequences(prompt_builder(tok), dev_episodes(settings), settings)

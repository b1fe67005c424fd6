"""The `minisci_tips` policy's data: dev variations only, the collector's own prompts (tip blocks as the
collector formats them, every step's prompt a prefix of its episode's chat), hindsight tips that say only what
the episode's observations showed, actions with tips that follow what the tips say, and a cache built once."""

import dataclasses
import json
import math
import random
import re

import pytest
import torch

from empo2.config import ConfigError, load_config
from empo2.config.presets import MINISCI_TIPS_LAYOUT
from empo2.envs import make_env
from empo2.envs.minisci import FAMILIES, catalogue
from empo2.envs.minisci.env import build
from empo2.envs.minisci.layout import Difficulty, Planner
from empo2.memory import TIP_HEADER, format_tip_block, sanitize_tip
from empo2.memory.tips import tip_request_message
from empo2.models import load_policy
from empo2.models.io import build_bpe_tokenizer, checkpoint_folder, load_local, shipped_prior
from empo2.rollout.prompts import PromptBuilder
from recipes.minisci_priors.prior import CONTEXT, IGNORED, SOFT, TARGET
from recipes.minisci_priors.prior_rounds import (
    _own_play,
    action_log_probs,
    another_house,
    decision_examples,
    decision_prompt,
    decision_shift,
    decision_states,
    expert_labels,
    foreign_tips,
    next_token_distributions,
    outside_category,
    reader_examples,
    replay,
    resign,
    self_play_examples,
    signature_match_accuracy,
    signature_match_batches,
    signature_match_examples,
    signature_match_logits,
    signature_match_loss,
)
from recipes.minisci_priors.prior_tips import (
    IRRELEVANT,
    LOCATED,
    MISLED,
    OTHER_HOUSE,
    OTHER_VARIATION,
    SEARCH,
    TIP_FREE,
    TipPriorSettings,
    dev_episodes,
    ensure_minisci_tips,
    episode_sequence,
    hindsight_tip,
    locates,
    prompt_builder,
    tips_signed,
    training_sequences,
)

# the default vocabulary: with a smaller one, episodes overflow the prompt budget
SMALL = TipPriorSettings(houses_per_variation=1, epochs=0.01, hidden_size=32, num_layers=1)


@pytest.fixture(scope="module")
def data():
    return dev_episodes(SMALL)


@pytest.fixture(scope="module")
def builder(data):
    texts = [hindsight_tip(e) for inst in data[:20] for e in inst.episodes]
    texts += [t for inst in data[:20] for e in inst.episodes for pair in e.turns for t in pair]
    return prompt_builder(build_bpe_tokenizer(texts, 400))


def test_every_episode_is_of_a_dev_variation_and_scripted_paths_win(data):
    cat = catalogue()
    dev = {(t, v) for t in cat.tasks() for v in cat.split(t, "dev")}
    # every in-distribution dev instance, in houses_per_variation house draws
    assert len(data) == SMALL.houses_per_variation * len(dev)
    assert {(inst.gold.family, inst.gold.variation) for inst in data} == dev
    for inst in data:
        gold = inst.gold
        assert (gold.family, gold.variation) in dev and gold.family not in cat.ood_tasks
        assert all((e.family, e.variation, e.house) == (gold.family, gold.variation, gold.house)
                   for e in inst.episodes)
        for ep in (gold, inst.search, *([inst.misled] if inst.misled else [])):  # won, or cut at max_turns
            assert ep.score == 100 or len(ep.turns) == SMALL.max_turns
        assert all(len(e.turns) <= SMALL.max_turns for e in inst.episodes)
    misled = sum(inst.misled is not None for inst in data)
    assert 0.3 * len(data) < misled < 0.7 * len(data)  # misled_rate 0.5


def test_the_tip_free_agent_falls_for_the_trap_at_trap_rate_and_the_search_never_does(data):
    """The prior-driven episode heads for the room the prior points to and focuses on the look-alike there
    (about trap_rate of the houses that have one); the careful search never focuses on a look-alike."""
    trapped = with_lookalikes = 0
    for inst in data:
        world, task = build(inst.gold.family, inst.gold.variation, Difficulty(**inst.gold.house))
        assert all(a.removeprefix("focus on ") not in task.lookalikes for _, a in inst.search.turns)
        if not task.lookalikes:
            continue
        with_lookalikes += 1
        if inst.habit.failed_focus is not None:
            trapped += 1
            assert inst.habit.failed_focus in task.lookalikes and inst.habit.score == 0
            # straight there: the look-alike it took is in the start room or the room its prior points to
            assert inst.habit.failed_focus in (task.lookalikes[0], *[n for n in task.lookalikes
                                                                     if world.room_of(n) == world.location])
    assert with_lookalikes > 100
    assert abs(trapped / with_lookalikes - SMALL.trap_rate) < 0.1


def test_hindsight_tips_state_only_what_the_episode_observed(data):
    for inst in data[::15]:
        for ep in inst.episodes:
            tip = hindsight_tip(ep)
            assert sanitize_tip(tip) == tip  # one clean line, storable as is
            chat = "\n".join(obs for obs, _ in ep.turns) + "\n" + ep.final_obs
            assert "Visited" not in tip and set(ep.sightings) <= set(_sought(ep))  # what the house hides
            for thing, room in ep.sightings.items():
                assert f"{thing} in the {room}" in tip
                assert thing in chat and room in chat  # the chat showed both
            assert f"Final score {ep.score}." in tip
            if ep.failed_focus:
                assert f"focus on {ep.failed_focus}" in [a for _, a in ep.turns]


def _check_sequence(builder, ids, kinds, ep, tips, signature=False):
    """`ids` is `ep`'s tip request chat with `tips` in every turn (the collector's own block, the same in each
    turn) plus its hindsight tip; each step's prompt, as the collector builds it, is a prefix of it, followed by
    the action and end of turn as TARGETs, and nothing else is a target but the tip."""
    tok = builder.tokenizer
    eos = tok.eos_token_id
    text = tok.decode(ids)
    if tips:
        block = format_tip_block(tips)
        assert text.count(block) == len(ep.turns)
    else:
        assert TIP_HEADER not in text
    for t, (obs, action) in enumerate(ep.turns):
        prompt = builder.build(ep.task, ep.turns[:t], obs, tips, [tips] * t if tips else None).ids
        target = tok.encode(action, add_special_tokens=False) + [eos]
        assert ids[:len(prompt)] == prompt and ids[len(prompt):len(prompt) + len(target)] == target
        assert kinds[len(prompt):len(prompt) + len(target)] == [TARGET] * len(target)
    request = builder.build_tip_request(ep.task, ep.turns, ep.final_obs,
                                        history_tips=[tips] * len(ep.turns) if tips else None)
    assert ids[:len(request)] == request and tok.decode(ids[len(request):-1]) == hindsight_tip(ep, signature)
    assert kinds[len(request):] == [TARGET] * (len(ids) - len(request)) and ids[-1] == eos
    assert kinds.count(TARGET) == len(ids) - len(request) + sum(
        len(tok.encode(a, add_special_tokens=False)) + 1 for _, a in ep.turns)
    assert set(kinds) <= {CONTEXT, TARGET}


def _tips_of(builder, ids):
    text = builder.tokenizer.decode(ids)
    if TIP_HEADER not in text:
        return None
    block = text[text.index(TIP_HEADER):text.index("</tip>\n<|im_end|>") + len("</tip>\n")]
    return [line[len("<tip>"):-len("</tip>")] for line in block.splitlines()[1:]]


def test_each_episode_is_labelled_with_what_a_reader_of_its_tips_does(data, builder):
    """TIP_FREE: the prior-driven episode without tips. LOCATED: the gold path under the instance's own tips,
    one of which says where everything needed is. SEARCH: the careful search under the prior-driven episode's
    tip, which located nothing (it names the failed look-alike). IRRELEVANT: the prior-driven episode again
    under another family's tips. MISLED: the episode that trusts the wrong tip."""
    insts = data[::12][:24]  # every family
    sequences = iter(training_sequences(builder, insts, SMALL))  # instance by instance, kinds in this order
    irrelevant = 0
    for inst in insts:
        own = {hindsight_tip(e) for e in (inst.gold, inst.habit, inst.search)}
        kind, ids, kinds = next(sequences)
        assert kind == TIP_FREE
        _check_sequence(builder, ids, kinds, inst.habit, None)
        kind, ids, kinds = next(sequences)
        tips = _tips_of(builder, ids)
        assert kind == LOCATED and 1 <= len(tips) <= 3 and set(tips) <= own
        assert any(hindsight_tip(e) in tips for e in (inst.gold, inst.search) if locates(e))
        _check_sequence(builder, ids, kinds, inst.gold, tips)
        kind, ids, kinds = next(sequences)
        if not locates(inst.habit):
            assert kind == SEARCH and _tips_of(builder, ids) == [hindsight_tip(inst.habit)]
            _check_sequence(builder, ids, kinds, inst.search, [hindsight_tip(inst.habit)])
            kind, ids, kinds = next(sequences, (None, None, None))
        if kind == IRRELEVANT:
            tips = _tips_of(builder, ids)
            own_family = {hindsight_tip(e) for other in data if other.gold.family == inst.gold.family
                          for e in other.episodes}
            assert tips and not set(tips) & own_family  # another family's tips: nothing about this house
            _check_sequence(builder, ids, kinds, inst.habit, tips)
            irrelevant += 1
            kind, ids, kinds = next(sequences, (None, None, None))
        if inst.misled:
            assert kind == MISLED
            _check_sequence(builder, ids, kinds, inst.misled, [inst.wrong_tip()])
        else:
            sequences = iter([(kind, ids, kinds), *sequences])  # not this instance's: put it back
    assert next(sequences, (None,))[0] is None
    assert 0 < irrelevant < len(insts)  # irrelevant_rate 0.5


def test_other_variations_tips_name_nothing_of_the_task_and_leave_the_prior_driven_episode_as_it_is(data, builder):
    """OTHER_VARIATION (off in the default settings, which keep the sequences builds up to 5 trained on): after an
    instance's other kinds, the prior-driven episode under 1-3 tips of one instance of another variation of its
    family, none naming a sought thing or a look-alike of this task."""
    insts = [inst for inst in data if inst.gold.family == "find-living-thing"][:30]
    plain = training_sequences(builder, insts, SMALL)
    assert OTHER_VARIATION not in {kind for kind, _, _ in plain}
    on = training_sequences(builder, insts, dataclasses.replace(SMALL, other_variation_rate=1.0))
    checked, current = 0, iter(insts)
    for kind, ids, kinds in on:  # each instance's sequences begin with its TIP_FREE one
        if kind == TIP_FREE:
            inst = next(current)
        if kind != OTHER_VARIATION:
            continue
        tips = _tips_of(builder, ids)
        assert tips and 1 <= len(tips) <= 3
        task = build(inst.gold.family, inst.gold.variation, Difficulty(**inst.gold.house))[1]
        assert not any(name in tip for tip in tips for name in (*task.sought, *task.lookalikes))
        donors = {hindsight_tip(e) for other in data if other.gold.family == inst.gold.family
                  and other.gold.variation != inst.gold.variation for e in other.episodes}
        assert set(tips) <= donors
        _check_sequence(builder, ids, kinds, inst.habit, tips)
        checked += 1
    assert checked >= 20


def test_a_tasks_signature_is_words_of_its_description_that_tell_its_instances_apart():
    for family in FAMILIES:
        signatures = set()
        for variation in range(12):
            task = build(family, variation, Difficulty(num_rooms=4, num_decoys=1, num_distractors=1))[1]
            assert task.signature and all(part in task.description for part in task.signature.split(", "))
            signatures.add(task.signature)
        assert len(signatures) >= 3, family  # (mix-paint makes one of 3 colours: its description tells no more)


def test_signed_tips_open_with_the_signature_and_another_houses_tips_leave_the_prior_driven_episode(data, builder):
    """With `tip_signature` every tip, as target and in a prompt, is the unsigned one after `Goal: <signature>.`;
    OTHER_HOUSE (`other_house_rate`) is the prior-driven episode under 1-3 tips of one instance of another
    variation of the family whose signature is not this task's, naming what they name; without signatures such
    tips would read as the instance's own, so the setting is refused."""
    insts = [inst for inst in data if inst.gold.family == "find-living-thing"][:30]
    with pytest.raises(ValueError, match="other_house_rate needs tip_signature"):
        training_sequences(builder, insts, dataclasses.replace(SMALL, other_house_rate=1.0))
    for ep in insts[0].episodes:
        assert hindsight_tip(ep, True) == f"Goal: {ep.signature}. {hindsight_tip(ep)}"
    assert not any(kind == OTHER_HOUSE for kind, _, _ in training_sequences(builder, insts, SMALL))
    on = training_sequences(builder, insts, dataclasses.replace(SMALL, tip_signature=True, other_house_rate=1.0))
    checked, naming, current = 0, 0, iter(insts)
    for kind, ids, kinds in on:  # each instance's sequences begin with its TIP_FREE one
        if kind == TIP_FREE:
            inst = next(current)
        tips = _tips_of(builder, ids) or []
        assert all(tip.startswith("Goal: ") for tip in tips)
        own = f"Goal: {inst.gold.signature}."
        if kind == LOCATED:
            assert all(tip.startswith(own) for tip in tips)
        if kind != OTHER_HOUSE:
            continue
        assert 1 <= len(tips) <= 3 and not any(tip.startswith(own) for tip in tips)
        donors = {hindsight_tip(e, True) for other in data if other.gold.family == inst.gold.family
                  and other.gold.variation != inst.gold.variation for e in other.episodes}
        assert set(tips) <= donors
        task = build(inst.gold.family, inst.gold.variation, Difficulty(**inst.gold.house))[1]
        naming += any(thing in tip for tip in tips for thing in task.candidates)  # reads like a true tip but for
        # its signature
        _check_sequence(builder, ids, kinds, inst.habit, tips, signature=True)
        checked += 1
    assert checked >= 20 and naming >= checked // 2


def test_a_checkpoint_says_whether_its_tips_are_signed(tmp_path, monkeypatch):
    """Probes and calibration label and write tips as the checkpoint learned them: a build records its settings,
    a probe its `tip_signature`; a checkpoint without a record is unsigned."""
    monkeypatch.setenv("EMPO2_CACHE", str(tmp_path))
    assert tips_signed(ensure_minisci_tips(dataclasses.replace(SMALL, tip_signature=True), log=lambda _: None))
    assert not tips_signed(tmp_path)
    (tmp_path / "empo2_source.json").write_text(json.dumps({"probe_of": "x", "tip_signature": True}))
    assert tips_signed(tmp_path)


def test_a_layout_where_prompts_are_not_prefixes_of_the_chat_is_refused(data, builder):
    windowed = PromptBuilder(builder.tokenizer, max_prompt_tokens=2048, history_turns=1, max_request_tokens=2048)
    gold = next(inst.gold for inst in data if len(inst.gold.turns) > 2)
    with pytest.raises(RuntimeError, match="not a prefix of the episode chat"):
        episode_sequence(windowed, gold, None)


def test_acting_on_a_wrong_tip_follows_it_then_recovers(data, builder):
    """A misled episode carries a tip that moves one sought thing to another room; its actions head for
    that room first (the label follows the tip, never contradicts it), then search, and win (or run out of
    steps) from there."""
    checked = 0
    for inst in data[:40]:
        if inst.misled is None:
            continue
        gold, misled = inst.gold, inst.misled
        moved = [(thing, room) for thing, room in gold.sightings.items() if f"{thing} in the {room}" not in
                 inst.wrong_tip()]
        assert len(moved) == 1
        thing, true_room = moved[0]
        told = inst.wrong_tip().split(f"{thing} in the ")[1].split(",")[0].split(".")[0]
        assert told != true_room and (misled.score == 100 or len(misled.turns) == SMALL.max_turns)
        env = make_env("minisci", max_steps=100, **gold.house)
        env.reset(task=gold.family, variation=gold.variation)
        plan = Planner(env._world)
        plan.go(told)
        actions = [a for _, a in misled.turns]
        assert actions[:len(plan.actions)] == plan.actions  # straight to the room the tip names
        prompt = builder.build(gold.task, [], misled.turns[0][0], [inst.wrong_tip()])
        assert prompt.has_tips and builder.tokenizer.decode(prompt.ids).count(inst.wrong_tip()) == 1
        checked += 1
    assert checked >= 10


def _sought(ep):
    world, task = build(ep.family, ep.variation, Difficulty(**ep.house))
    return task.sought


def test_the_policy_is_built_once_and_loads_as_a_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("EMPO2_CACHE", str(tmp_path))
    logs = []
    path = ensure_minisci_tips(SMALL, log=logs.append)
    assert (path / "empo2_source.json").is_file() and path.name.startswith("minisci_tips-")
    # it records the layout it was trained on, so `model.name=hf model.path=` copies are held to it (test_config)
    assert json.loads((path / "empo2_source.json").read_text())["prompt_layout"] == MINISCI_TIPS_LAYOUT
    assert ensure_minisci_tips(SMALL, log=logs.append) == path
    assert sum("building" in line for line in logs) == 1
    model, tok = load_local(path, torch.float32)
    assert model.config.hidden_size == SMALL.hidden_size and tok.eos_token == "<|im_end|>"


@pytest.mark.parametrize("name", ["minisci_tips_reader", "minisci_tips_signed"])
def test_a_shipped_prior_loads_on_its_own_layout_and_records_how_it_was_made(name):
    cfg = load_config([f"model={name}"])  # the preset selects rollout=whole_chat, as minisci_tips does
    assert cfg.model.name == name and (cfg.rollout.history_turns, cfg.rollout.tips_in_history) == (None, True)
    with pytest.raises(ConfigError, match=rf"^rollout.history_turns=2 is not allowed with model.name={name}"):
        load_config([f"model={name}", "rollout.history_turns=2"])
    source = json.loads((shipped_prior(name) / "empo2_source.json").read_text())
    assert source["prompt_layout"] == MINISCI_TIPS_LAYOUT
    # calibration and the probes find the record from the preset alone, as from model.path
    assert checkpoint_folder(cfg.model) == shipped_prior(name)
    hf = load_config(["model=minisci_tips", "model.name=hf", f"model.path={shipped_prior(name)}"]).model
    assert checkpoint_folder(hf) == shipped_prior(name)
    if name == "minisci_tips_reader":
        assert "--learn actions --iterations 2" in source["command"] and len(source["self_play"]) == 2
        assert not tips_signed(shipped_prior(name))
    else:  # build 7 and four self-play rounds, each starting where the one before it wrote its checkpoint
        assert tips_signed(shipped_prior(name)) and "version=7" in source["chain"][0]
        assert source["command"] == source["chain"][-1].split("  #")[0] and len(source["self_play"]) == 1
        for before, after in zip(source["chain"][1:], source["chain"][2:]):
            assert f"--start {before.split('--out ')[1].split()[0]} " in after
        assert source["args"]["start"] in source["chain"][-2] and source["args"]["setting"][-2:] == \
            ["tip_signature=1", "version=7"]
    model, tok = load_policy(cfg.model)
    assert model.config.hidden_size == TipPriorSettings().hidden_size and tok.eos_token == "<|im_end|>"
    assert sum(p.numel() for p in model.parameters()) < 1_000_000


@pytest.fixture(scope="module")
def small_policy(data):
    """A random tiny model with a tokenizer of the dev episodes' text: its play is a policy's own, not scripted."""
    from empo2.models.io import build_tiny_model
    from empo2.rollout.prompts import DEFAULT_SYSTEM_PROMPT

    texts = [DEFAULT_SYSTEM_PROMPT, tip_request_message()["content"], TIP_HEADER]
    episodes = [e for inst in data for e in inst.episodes]
    texts += [e.task for e in episodes] + [hindsight_tip(e) for e in episodes]
    texts += [t for inst in data[:100] for e in inst.episodes for pair in e.turns for t in pair]
    tok = build_bpe_tokenizer(texts, SMALL.vocab_size)
    return build_tiny_model(tok, 0, hidden_size=32, num_layers=1, num_heads=2), tok


def test_an_own_episode_is_labelled_by_replaying_what_the_policy_generated(data, small_policy):
    """The hindsight tip of a policy's episode is the one of the actions it generated, replayed in the same
    house: a trapped episode's tip names the look-alike it focused on; a replay that does not end where the
    trajectory did is no label."""
    from empo2.rollout.types import StepSample, Trajectory

    _, tok = small_policy
    eos = tok.eos_token_id
    inst = next(i for i in data if i.habit.failed_focus)
    ep = inst.habit
    env = make_env("minisci", max_steps=100, **ep.house)

    def trajectory(actions, score):
        samples = [StepSample([], [], tok.encode(a, add_special_tokens=False) + [eos], False, False, 0, 0, t)
                   for t, a in enumerate(actions)]
        return Trajectory(ep.family, ep.variation, 0, 0, samples=samples, score=score)

    actions = [a for _, a in ep.turns]
    got = replay(env, ep.family, ep.variation, ep.house, trajectory(actions, ep.score), tok, SMALL.max_turns)
    assert got is not None and hindsight_tip(got) == hindsight_tip(ep)
    assert f"Focusing on the {ep.failed_focus} failed." in hindsight_tip(got)
    assert replay(env, ep.family, ep.variation, ep.house, trajectory(actions, 100.0), tok, SMALL.max_turns) is None
    assert replay(env, ep.family, ep.variation, ep.house, trajectory(actions + ["look around"], ep.score), tok,
                  SMALL.max_turns) is None  # the episode ended before its last action


def test_self_play_trains_the_collectors_own_tip_requests_on_the_replayed_tip(small_policy):
    """Every episode played gives one example: an episode chat ending in the collector's tip request, all
    IGNORED (only the tip is learned, not the policy's own actions or its earlier, possibly false, tips), then a
    hindsight tip and end of turn as TARGETs. (That the tip is the episode's own is the replay test's part.)"""
    model, tok = small_policy
    examples, stats = self_play_examples(model, tok, episodes_per_instance=2, variations_per_family=1,
                                         log=lambda _: None)
    cat = catalogue()
    families = [t for t in cat.tasks() if t not in cat.ood_tasks]
    assert stats["unreplayable"] == 0 and len(examples) == stats["episodes"] == 2 * len(families)
    request = tip_request_message()["content"] + "<|im_end|>\n<|im_start|>assistant\n"
    for ids, kinds in examples:
        n = kinds.index(TARGET)
        assert set(kinds[:n]) == {IGNORED} and kinds[n:] == [TARGET] * (len(ids) - n) and ids[-1] == tok.eos_token_id
        text = tok.decode(ids[:n])
        assert text.endswith(request) and text.count("<|im_start|>user") >= 2  # the episode chat, then the request
        tip = tok.decode(ids[n:-1])
        assert tip.startswith("Seen: ") and tip.endswith(".") and "Final score " in tip


def test_the_expert_labels_every_state_reached_by_moves_with_the_gold_plan_from_there(data):
    """On the gold path the labels are the gold path, up to and including its first action that is not a move;
    after a detour into a wrong room they lead back (moves only) to where the gold plan's first other action is
    taken, and taking it scores; a failed focus ends the labels."""
    def detour(inst):
        """A first move that leaves the gold path for a room that is not the target's, if the start has one."""
        path = [a for _, a in inst.gold.turns]
        env = make_env("minisci", max_steps=100, **inst.gold.house)
        env.reset(task=inst.gold.family, variation=inst.gold.variation)
        focus = next(a for a in path if not a.startswith("go to "))
        room = env._world.room_of(focus.removeprefix("focus on "))
        return next((a for a in env.valid_actions() if a.startswith("go to ") and a not in (path[0], f"go to {room}")),
                    None)

    inst = next(i for i in data if i.gold.family == "find-living-thing" and detour(i))
    gold = inst.gold
    env = make_env("minisci", max_steps=100, **gold.house)
    key = (gold.family, gold.variation)
    path = [a for _, a in gold.turns]
    first_other = next(i for i, a in enumerate(path) if not a.startswith("go to "))
    assert expert_labels(env, *key, path) == path[:first_other + 1]

    actions = [detour(inst)]
    while actions[-1].startswith("go to ") and len(actions) < 10:  # play the expert from the detour on
        actions.append(expert_labels(env, *key, actions + ["look around"])[-1])
    assert actions[-1] == path[first_other] and all(a.startswith("go to ") for a in actions[:-1])
    env.reset(task=gold.family, variation=gold.variation)
    results = [env.step(a) for a in actions]
    assert not any(r.info["failed"] for r in results) and results[-1].info["score"] >= 50  # the focus took

    if inst.habit.failed_focus:  # the trapped episode: nothing after its failed focus is labelled
        trapped = [a for _, a in inst.habit.turns]
        assert len(expert_labels(env, *key, trapped + ["look around"])) == len(trapped)


def test_reader_examples_label_the_collectors_own_prompts_under_a_locating_tip(small_policy):
    """One example per state reached while only moving: the collector's prompt at that step (IGNORED), carrying
    the gold path's tip in its tip block, then the expert's action and end of turn (TARGET); the first step's
    label is the gold path's first action in that instance's house."""
    model, tok = small_policy
    examples, stats = reader_examples(model, tok, variations_per_family=1, log=lambda _: None)
    _, chunk, _, _, envs, _ = next(_own_play(model, tok, 10, 1, 0))
    assert len(examples) == stats["states"] >= stats["episodes"] == len(chunk)
    firsts = []
    for ids, kinds in examples:
        n = kinds.index(TARGET)
        assert set(kinds[:n]) == {IGNORED} and kinds[n:] == [TARGET] * (len(ids) - n) and ids[-1] == tok.eos_token_id
        prompt = tok.decode(ids[:n])
        assert TIP_HEADER in prompt and "<tip>Seen: " in prompt and prompt.endswith("<|im_start|>assistant\n")
        if prompt.count("<|im_start|>assistant") == 1:
            firsts.append(tok.decode(ids[n:-1]))
    golds = []
    for (family, variation, _), env in zip(chunk, envs):
        env.reset(task=family, variation=variation)
        golds.append(env.gold_actions()[0])
    assert firsts == golds


def test_foreign_tips_are_another_house_of_the_same_family_or_another_task():
    """Each instance borrows 1-3 of the tips of one other instance: of its family and never of its own variation
    (another house draw of it would describe its own house), or of another family; with no such other in the
    chunk it borrows nothing. In time every eligible donor is drawn."""
    import random

    chunk = [("a", 1, {}), ("a", 2, {}), ("b", 3, {}), ("a", 4, {}), ("c", 5, {}), ("c", 5, {"num_rooms": 5})]
    played = [[f"tip {j}.{k}" for k in range(3)] for j in range(len(chunk))]
    for same_family in (True, False):
        rng = random.Random(0)
        seen, eligible = set(), set()
        for _ in range(60):
            for i, got in enumerate(foreign_tips(chunk, played, rng, same_family)):
                family, variation, _ = chunk[i]
                donors = {j for j, (f, v, _) in enumerate(chunk)
                          if (f == family and v != variation if same_family else f != family)}
                eligible |= {(i, j) for j in donors}
                if not donors:
                    assert got == []
                    continue
                assert 1 <= len(got) <= 3 and len(set(got)) == len(got)
                (donor,) = {int(tip.split()[1].split(".")[0]) for tip in got}
                assert donor in donors
                seen.add((i, donor))
        assert seen == eligible and eligible
    got = foreign_tips(chunk, played, random.Random(0))
    assert got[2] == got[4] == got[5] == []  # b alone in its family; c's two houses of one variation


def test_another_category_s_tips_name_a_thing_the_task_could_never_accept():
    """`foreign="category"` donors: find-living-thing houses whose target the borrower's task category does not
    admit (an animal task borrows a plant house's tips, never another animal's; "a living thing" admits both, so it
    borrows none), and no other family borrows."""
    import random

    from empo2.envs.minisci.search_families import ANIMALS, PLANTS

    house = {"num_rooms": 4, "num_decoys": 1, "num_distractors": 1}
    chunk = [("find-living-thing", v, house) for v in range(24)] + [("power-component", 0, house)]
    tasks = [build(f, v, Difficulty(**h))[1] for f, v, h in chunk]
    allowed = outside_category(chunk)
    kinds = [t.description.split(" find ")[1].split(".")[0] for t in tasks[:-1]]
    assert {"an animal", "a plant", "a living thing"} <= set(kinds)
    for i, kind in enumerate(kinds):
        for j in range(len(kinds)):
            admits = {"an animal": ANIMALS, "a plant": PLANTS, "a living thing": ANIMALS + PLANTS}[kind]
            assert allowed(i, j) == (tasks[j].target not in admits)
        assert not allowed(i, len(chunk) - 1) and not allowed(len(chunk) - 1, i)
    played = [[f"tip {j}.{k}" for k in range(3)] for j in range(len(chunk))]
    got = foreign_tips(chunk, played, random.Random(0), True, allowed)
    for i, tips in enumerate(got):
        donors = {int(tip.split()[1].split(".")[0]) for tip in tips}
        assert all(allowed(i, j) for j in donors)
        assert (tips == []) == (i == len(chunk) - 1 or kinds[i] == "a living thing")


@pytest.mark.parametrize("kind,distill", [("house", False), ("task", False), ("house", True)])
def test_under_foreign_tips_every_state_is_labelled_with_what_it_samples_from_the_tip_free_prompt(
        small_policy, monkeypatch, kind, distill):
    """One example per state reached with tips in the prompt: that prompt (IGNORED), then the action the policy
    generated from the same prompt with every tip block cut out, and end of turn (TARGET); with `distill`, the
    same tokens as SOFT targets carrying the tip-free prompt's next-token distribution at each."""
    import re

    import recipes.minisci_priors.prior_rounds as prior_rounds

    calls = []

    class Recording:  # the collector's real engine, keeping what each generate call was given and returned
        def __init__(self, engine):
            self.engine = engine

        def generate(self, prompts, params, seed=None):
            gens = self.engine.generate(prompts, params, seed=seed)
            calls.append(([list(p) for p in prompts], gens))
            return gens

        def __getattr__(self, name):
            return getattr(self.engine, name)

    own_play = prior_rounds._own_play

    def recorded(*args, **kwargs):
        for done, chunk, worker, spec, envs, tasks in own_play(*args, **kwargs):
            yield done, chunk, worker.using(engine=Recording(worker.engine)), spec, envs, tasks

    monkeypatch.setattr(prior_rounds, "_own_play", recorded)
    model, tok = small_policy
    examples, stats = reader_examples(model, tok, variations_per_family=2, foreign=kind, distill=distill,
                                      log=lambda _: None)
    tip_free, gens = calls[-1]  # after the episodes: one call over the tip-free prompts of every state
    assert len(examples) == stats["states"] == len(tip_free) >= stats["episodes"] > 0
    block = re.compile(r"\n\n" + re.escape(TIP_HEADER) + r"\n(?:<tip>[^\n]*</tip>\n)+")
    label = SOFT if distill else TARGET
    for (ids, kinds, *probs), prompt, gen in zip(examples, tip_free, gens):
        n = kinds.index(label)
        assert set(kinds[:n]) == {IGNORED} and kinds[n:] == [label] * (len(ids) - n) and len(probs) == distill
        text = tok.decode(ids[:n])
        assert TIP_HEADER in text and block.sub("", text) == tok.decode(prompt)
        assert ids[n:] == tok.encode(gen.text.strip(), add_special_tokens=False) + [tok.eos_token_id]
        if distill:  # the tip-free prompt's distributions, not the prompt with tips
            assert torch.allclose(probs[0], next_token_distributions(model, [prompt], [ids[n:]])[0], atol=1e-5)


def test_contrast_twins_are_the_labelled_states_under_another_houses_signed_tips(small_policy, monkeypatch):
    """With `contrast`, every state labelled by the expert under the instance's own tips has one twin: the same
    prompt but for its tip blocks, which hold only tips signed for another house of the family, labelled with what
    the policy samples from the tip-free prompt (the distribution, with `distill`); the two cut to the same tip-free
    prompt as the collector's own."""
    import re

    model, tok = small_policy
    examples, stats = reader_examples(model, tok, variations_per_family=2, signature=True, contrast=True,
                                      distill=True, log=lambda _: None)
    own = [ex for ex in examples if len(ex) == 2]
    twins = [ex for ex in examples if len(ex) == 3]
    assert len(own) == stats["states"] == len(twins) == stats["twins"] > 0
    block = re.compile(r"\n\n" + re.escape(TIP_HEADER) + r"\n(?:<tip>[^\n]*</tip>\n)+")

    def parts(ex, kind):
        n = ex[1].index(kind)
        text = tok.decode(ex[0][:n])
        return block.sub("", text), re.findall(r"<tip>Goal: ([^.]*)\.", text)

    own_parts, twin_parts = [parts(ex, TARGET) for ex in own], [parts(ex, SOFT) for ex in twins]
    assert sorted(p for p, _ in own_parts) == sorted(p for p, _ in twin_parts)  # the same states, tips cut out
    signed_as = {}
    for prompt, signed in own_parts:  # the own tips name the instance the prompt's task is about
        assert len(set(signed)) == 1
        signed_as.setdefault(prompt, set(signed))
    for prompt, signed in twin_parts:
        assert signed and not set(signed) & signed_as[prompt]


def test_next_token_distributions_batched_match_one_by_one_and_a_full_forward(small_policy):
    """Right-padded batches give each pair what it gets alone (loop vs vectorised), row k is the softmax of the
    logits that predict target token k, and every row is a distribution."""
    model, tok = small_policy
    prompts = [tok.encode(t, add_special_tokens=False) for t in ("You see a door.", "Go to the kitchen now, then", "A")]
    targets = [tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in ("look around", "wait", "go")]
    batched = next_token_distributions(model, prompts, targets, batch_size=2)  # two batches, one with padding
    for p, t, got in zip(prompts, targets, batched):
        alone = next_token_distributions(model, [p], [t])[0]
        with torch.no_grad():
            full = torch.softmax(model(input_ids=torch.tensor([p + t])).logits[0], dim=-1)  # (T, V)
        assert got.shape == (len(t), model.config.vocab_size)
        assert torch.allclose(got, alone, atol=1e-5) and torch.allclose(got, full[len(p) - 1:-1], atol=1e-5)
        assert torch.allclose(got.sum(-1), torch.ones(len(t)), atol=1e-5)


def test_a_finished_build_is_found_in_the_cache_first_then_among_the_shipped_ones(tmp_path, monkeypatch):
    import recipes.minisci_priors.prior as prior

    monkeypatch.setenv("EMPO2_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(prior, "SHIPPED", tmp_path / "shipped")
    name = prior.cache_dir(SMALL, "minisci_tips").name
    assert prior.ready_path("minisci_tips", SMALL) is None
    (tmp_path / "shipped" / name).mkdir(parents=True)
    assert prior.ready_path("minisci_tips", SMALL) is None  # unfinished: no record written last
    (tmp_path / "shipped" / name / "empo2_source.json").write_text("{}")
    assert prior.ready_path("minisci_tips", SMALL) == tmp_path / "shipped" / name
    other = prior.cache_dir(TipPriorSettings(epochs=0.02, hidden_size=32, num_layers=1),
                            "minisci_tips").name
    assert other != name  # a changed setting never picks up another build's copy
    cached = prior.cache_dir(SMALL, "minisci_tips")
    cached.mkdir(parents=True)
    (cached / "empo2_source.json").write_text("{}")
    assert prior.ready_path("minisci_tips", SMALL) == cached


def test_a_build_cached_before_its_preset_took_its_options_name_is_found_not_made_again(tmp_path, monkeypatch):
    """A cache folder the recipe wrote while the preset was named `minisci-tips` (`minisci-tips-<settings key>`) holds
    today's `minisci_tips` with those settings: the recipe and `model=minisci_tips|minisci_bc` find it there."""
    import recipes.minisci_priors.prior as prior
    from empo2.models.io import RECIPE_BUILT, recipe_prior

    monkeypatch.setenv("EMPO2_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(prior, "SHIPPED", tmp_path / "shipped")
    models = tmp_path / "cache" / "models"
    old = models / prior.cache_dir(SMALL, "minisci_tips").name.replace("minisci_tips", "minisci-tips")
    old.mkdir(parents=True)
    (old / "empo2_source.json").write_text("{}")
    assert prior.ready_path("minisci_tips", SMALL) == old
    assert prior.ensure_cached("minisci_tips", SMALL, build=None) == old  # nothing is built
    old_bc = models / RECIPE_BUILT["minisci_bc"].replace("minisci_bc", "minisci-bc")
    old_bc.mkdir()
    (old_bc / "empo2_source.json").write_text("{}")
    assert recipe_prior("minisci_bc") == old_bc


def test_action_log_probs_sum_their_tokens_log_probs(small_policy):
    """Each action's log-probability is that of its tokens then end of turn, from one full forward of prompt +
    action; distinct actions' probabilities sum to at most 1."""
    model, tok = small_policy
    prompt = tok.encode("You are in the kitchen. You see a green box.", add_special_tokens=False)
    actions = ["look around", "go to hallway", "focus on green box"]
    got = action_log_probs(model, tok, prompt, actions)
    for action, p in zip(actions, got):
        target = tok.encode(action, add_special_tokens=False) + [tok.eos_token_id]
        with torch.no_grad():
            log_q = torch.log_softmax(model(input_ids=torch.tensor([prompt + target])).logits[0], dim=-1)  # (T, V)
        expected = sum(log_q[len(prompt) - 1 + k, t].item() for k, t in enumerate(target))
        assert p.item() == pytest.approx(expected, abs=1e-4)
    assert got.exp().sum().item() <= 1.0 + 1e-6


def test_distilled_labels_and_contrast_are_refused_where_they_cannot_apply(small_policy):
    model, tok = small_policy
    with pytest.raises(ValueError, match="distill labels states under another instance's tips"):
        reader_examples(model, tok, variations_per_family=1, distill=True, log=lambda _: None)
    with pytest.raises(ValueError, match="only signed tips"):
        reader_examples(model, tok, variations_per_family=1, contrast=True, log=lambda _: None)
    with pytest.raises(ValueError, match="only signed tips"):
        reader_examples(model, tok, variations_per_family=1, contrast=True, signature=True, foreign="house",
                        log=lambda _: None)


def _decision_states(n_per_family: int = 6):
    """The decision states of the first dev variations of each in-distribution family, two house draws each."""
    import random

    from empo2.envs.minisci import OOD_FAMILIES
    from recipes.minisci_priors.prior import dev_instances

    instances = [i for i in dev_instances(random.Random(0), 2) if i[0] not in OOD_FAMILIES]
    return decision_states([i for f in FAMILIES for i in [j for j in instances if j[0] == f][:n_per_family]])


def test_a_decision_state_is_where_the_gold_path_and_the_trapped_path_part():
    """Reached along the actions both paths share, on dev variations only; the gold path's action there is valid and
    is not the trapped path's, and the prompt there is the collector's own with the tips in every turn."""
    states = _decision_states()
    cat = catalogue()
    assert {s.family for s in states} >= {"find-living-thing", "power-component"}
    for s in states:
        assert s.variation in cat.split(s.family, "dev")
        k = len(s.turns)
        gold, trapped = [a for _, a in s.gold.turns], [a for _, a in s.trapped.turns]
        assert gold[:k] == trapped[:k] == [a for _, a in s.turns] and gold[k] == s.good != trapped[k]
        assert s.good in s.actions
        env = make_env("minisci", max_steps=100, **s.house)
        obs, _ = env.reset(task=s.family, variation=s.variation)
        for action in gold[:k]:
            obs = env.step(action).obs
        assert obs == s.obs and env.valid_actions() == s.actions  # the state itself, replayed
    builder = prompt_builder(build_bpe_tokenizer([s.task for s in states] + [s.obs for s in states], 400))
    s = next(s for s in states if s.turns)
    tips = [hindsight_tip(s.gold, True)]
    assert decision_prompt(builder, s, tips) == builder.build(s.task, s.turns, s.obs, tips, [tips] * len(s.turns)).ids


def test_decision_examples_contrast_own_and_another_houses_signed_tips_on_the_same_prompt(small_policy):
    """Per state: the gold action under its own signed tips (hard); under another house's, and tip-free, the
    tip-free prompt's distribution along an action sampled from it (soft); every prompt is the same state's, its tips
    the only difference; another house is of the same family with another signature."""
    import random
    import re

    model, tok = small_policy
    states = _decision_states(3)
    examples = decision_examples(model, tok, states, foreign_per_state=2, seed=0)
    hard = [ex for ex in examples if len(ex) == 2]
    soft = [ex for ex in examples if len(ex) == 3]
    borrows = [any(t.family == s.family and t.gold.signature != s.gold.signature for t in states) for s in states]
    assert any(borrows) and len(hard) == len(states) and len(soft) == sum(1 + 2 * b for b in borrows)
    block = re.compile(r"\n\n" + re.escape(TIP_HEADER) + r"\n(?:<tip>[^\n]*</tip>\n)+")
    builder = prompt_builder(tok)
    free = {tuple(decision_prompt(builder, s, None)): s for s in states}

    def split(ex, kind):
        n = ex[1].index(kind)
        assert set(ex[1][:n]) == {CONTEXT} and set(ex[1][n:]) == {kind}
        return ex[0][:n], ex[0][n:], re.findall(r"<tip>Goal: ([^.]*)\.", tok.decode(ex[0][:n]))

    for ex, s in zip(hard, states):
        prompt, target, signed = split(ex, TARGET)
        assert tok.decode(target, skip_special_tokens=True).strip() == s.good and set(signed) == {s.gold.signature}
    anchors = 0
    for ex in soft:
        prompt, target, signed = split(ex, SOFT)
        cut = tok(block.sub("", tok.decode(prompt)), add_special_tokens=False).input_ids
        state = free.get(tuple(prompt)) or free[tuple(cut)]
        anchors += not signed
        assert not set(signed) & {state.gold.signature}
        expected = next_token_distributions(model, [decision_prompt(builder, state, None)], [target])[0]
        assert torch.allclose(ex[2], expected, atol=1e-5)  # the tip-free prompt's, whatever tips the prompt holds
    assert anchors == len(states)  # one tip-free anchor each
    rng = random.Random(0)
    for i, (s, b) in enumerate(zip(states, borrows)):
        donor = another_house(states, i, rng)
        assert (donor is not None) == b and (not b or (donor.family == s.family
                                                       and donor.gold.signature != s.gold.signature))


def test_decision_shift_is_the_exact_probability_of_the_gold_action(small_policy):
    """Means over states of P(gold action) normalised over the valid actions (tip-free, under the state's own gold
    tip, under another house's) and of KL(tip-free || with the tip), as computed one by one; a state with no other
    house to borrow from is left out."""
    model, tok = small_policy
    states = [s for s in _decision_states(3) if s.family == "find-living-thing"]
    a, b = states[0], next(s for s in states if s.gold.signature != states[0].gold.signature)
    shift = decision_shift(model, tok, [a, b])
    builder = prompt_builder(tok)

    def dist(s, tip):
        log_p = action_log_probs(model, tok, decision_prompt(builder, s, [tip] if tip else None), s.actions)
        return log_p - log_p.logsumexp(0)

    for kind, tip_of in (("tip_free", lambda s, o: None), ("own", lambda s, o: hindsight_tip(s.gold, True)),
                         ("other_house", lambda s, o: hindsight_tip(o.gold, True)),
                         ("resigned", lambda s, o: resign(hindsight_tip(s.gold, True), o.gold.signature))):
        rows = [dist(s, tip_of(s, o)) for s, o in ((a, b), (b, a))]
        free = [dist(s, None) for s in (a, b)]
        gold = [r[s.actions.index(s.good)].exp().item() for r, s in zip(rows, (a, b))]
        kl = [(f.exp() * (f - r)).sum().item() for f, r in zip(free, rows)]
        assert shift[kind]["gold"] == pytest.approx(sum(gold) / 2, abs=1e-6)
        assert shift[kind]["kl"] == pytest.approx(sum(kl) / 2, abs=1e-6)
    assert shift["states"] == 2 and shift["tip_free"]["kl"] == 0.0
    assert decision_shift(model, tok, [a])["states"] == 0  # no other house to borrow from
    assert "resigned" not in decision_shift(model, tok, [a, b], signature=False)  # unsigned tips: no signature


def test_a_resigned_tip_is_the_same_tip_about_another_instance():
    tip = "Goal: green box, kitchen. Seen: frog in the bedroom. Focusing on the stapler failed. Final score 0."
    assert resign(tip, "red box, hallway") == ("Goal: red box, hallway. Seen: frog in the bedroom. Focusing on the "
                                               "stapler failed. Final score 0.")
    with pytest.raises(ValueError, match="not a signed tip"):
        resign("Seen: frog in the bedroom. Final score 100.", "red box, hallway")


def test_resigned_decision_examples_differ_from_the_own_tips_in_the_signature_only(small_policy):
    """With `resigned`, the tips of every SOFT example but the tip-free anchor are the state's own tips word for
    word (its gold path's, with its trapped episode's or not), signed with the signature of another house of its
    family; the hard examples are as without it."""
    import re

    model, tok = small_policy
    states = _decision_states(3)
    plain = decision_examples(model, tok, states, foreign_per_state=2, seed=0)
    examples = decision_examples(model, tok, states, foreign_per_state=2, seed=0, resigned=True)
    assert [ex for ex in examples if len(ex) == 2] == [ex for ex in plain if len(ex) == 2]
    assert len(examples) == len(plain)
    builder = prompt_builder(tok)
    block = re.compile(r"\n\n" + re.escape(TIP_HEADER) + r"\n(?:<tip>[^\n]*</tip>\n)+")
    tip = re.compile(r"<tip>Goal: ([^.]*)\. ([^<]*)</tip>")
    resigned = 0
    for ids, kinds, _ in (ex for ex in examples if len(ex) == 3):
        prompt = tok.decode(ids[:kinds.index(SOFT)])
        found = set(tip.findall(prompt))
        if not found:
            continue  # the tip-free anchor
        free = tok(block.sub("", prompt), add_special_tokens=False).input_ids
        (signature,) = {sig for sig, _ in found}
        said = {rest for _, rest in found}

        def own(s):  # the state's own tips without their signature
            return {hindsight_tip(e, True).split(". ", 1)[1] for e in (s.gold, s.trapped)}

        assert any(decision_prompt(builder, s, None) == free and hindsight_tip(s.gold, True).split(". ", 1)[1] in said
                   and said <= own(s) and signature != s.gold.signature
                   and any(t.family == s.family and t.gold.signature == signature for t in states) for s in states)
        resigned += 1
    assert resigned == sum(len(ex) == 3 for ex in examples) - len(states)  # all but one anchor per state


def test_signature_match_labels_each_field_of_every_tip_and_the_whole_signature_at_the_answer(small_policy):
    """Two prompts per state that has another house: under its gold tip, labelled 1 everywhere; under the same tip
    re-signed, 1 exactly at the fields it shares with the instance's signature and 0 at the prompt's last token.
    Each position is the token that ends its field, in every tip block of the whole chat."""
    _, tok = small_policy
    states = _decision_states(3)
    examples = signature_match_examples(tok, states, seed=0)
    builder = prompt_builder(tok)
    with_donor = [s for i, s in enumerate(states) if another_house(states, i, random.Random(0))]
    assert len(examples) == 2 * len(with_donor) > 0
    for n, (ids, positions, labels) in enumerate(examples):
        own_prompt = examples[n - n % 2][0]
        # (two house draws may reach the same state: the same prompt, so either serves)
        state = next(s for s in with_donor if decision_prompt(builder, s, [hindsight_tip(s.gold, True)]) == own_prompt)
        own, prompt = state.gold.signature, tok.decode(ids)
        (said,) = set(re.findall(r"<tip>Goal: ([^.]*)\. ", prompt))
        assert ids == decision_prompt(builder, state, [resign(hindsight_tip(state.gold, True), said)])
        assert (said == own) == (n % 2 == 0)
        fields = said.split(", ")
        blocks = prompt.count("<tip>")
        assert blocks == len(state.turns) + 1 and len(positions) == blocks * len(fields) + 1
        assert positions[-1] == len(ids) - 1 and labels[-1] == float(said == own)
        assert min(labels) == float(said == own)  # a re-signed prompt differs from its own in some field
        for k, (p, label) in enumerate(zip(positions[:-1], labels[:-1], strict=True)):
            field = fields[k % len(fields)]
            # token p completes the field (with the comma or full stop after it, should a merge join them)
            before, through = tok.decode(ids[:p]), tok.decode(ids[:p + 1])
            assert through.rstrip(",.").endswith(field) and not before.endswith(field)
            assert label == float(field == own.split(", ")[k % len(fields)])


def test_the_match_loss_is_per_example_binary_cross_entropy_and_accuracy_splits_answer_from_fields(small_policy):
    """Batched (right-padded) logits equal each example's own forward; the loss is their mean BCE; a head that
    answers "own" everywhere scores the share of 1 labels at the answer and at the fields; every pass of
    `signature_match_batches` holds each prompt once."""
    model, tok = small_policy
    states = _decision_states(2)
    examples = signature_match_examples(tok, states, seed=0)
    head = torch.nn.Linear(model.config.hidden_size, 1)
    torch.nn.init.normal_(head.weight, generator=torch.Generator().manual_seed(0))
    batch = examples[:5]
    with torch.no_grad():
        batched = signature_match_logits(model, head, batch)
        alone = torch.cat([signature_match_logits(model, head, [ex]) for ex in batch])
        loss = signature_match_loss(model, head, batch)
    assert batched.shape == (sum(len(pos) for _, pos, _ in batch),)
    assert torch.allclose(batched, alone, atol=1e-5)
    labels = [x for _, _, ls in batch for x in ls]
    by_hand = sum(-math.log(torch.sigmoid(z if y else -z).item()) for z, y in zip(batched, labels, strict=True))
    assert loss.item() == pytest.approx(by_hand / len(labels), rel=1e-5)

    torch.nn.init.zeros_(head.weight)
    torch.nn.init.constant_(head.bias, 1.0)  # logit > 0 everywhere: "own"
    accuracy = signature_match_accuracy(model, head, examples)
    answers = [ls[-1] for _, _, ls in examples]
    fields = [x for _, _, ls in examples for x in ls[:-1]]
    assert accuracy["answer"] == pytest.approx(sum(answers) / len(answers)) == pytest.approx(0.5)
    assert accuracy["fields"] == pytest.approx(sum(fields) / len(fields)) and 0.5 < accuracy["fields"] < 1

    batches = signature_match_batches(tok, states, seed=0, size=4)
    first = [next(batches) for _ in range(len(examples) // 4)]
    assert all(len(b) == 4 for b in first)
    seen = sorted(tuple(ids) for b in first for ids, _, _ in b)
    assert len(set(seen)) == len(seen)  # no prompt twice within a pass

"""The `minisci-tips` policy's data: dev variations only, the collector's own prompts (tip blocks as the
collector formats them, every step's prompt a prefix of its episode's chat), hindsight tips that say only what
the episode's observations showed, actions with tips that follow what the tips say, and a cache built once."""

import pytest
import torch

from empo2.envs import make_env
from empo2.envs.minisci import catalogue
from empo2.envs.minisci.env import build
from empo2.envs.minisci.layout import Difficulty, Planner
from empo2.memory import TIP_HEADER, format_tip_block, sanitize_tip
from empo2.models import _load_local, build_bpe_tokenizer
from empo2.prior import CONTEXT, IGNORED, TARGET
from empo2.prior_tips import (
    EXPLORER,
    MISLED,
    TIP_FREE,
    WITH_TIPS,
    TipPriorSettings,
    dev_episodes,
    ensure_minisci_tips,
    episode_sequence,
    hindsight_tip,
    prompt_builder,
    training_sequences,
)
from empo2.rollout.prompts import PromptBuilder

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


def test_every_episode_is_of_a_dev_variation_and_gold_paths_win(data):
    cat = catalogue()
    dev = {(t, v) for t in cat.tasks() for v in cat.split(t, "dev")}
    # every in-distribution dev instance, in houses_per_variation house draws
    assert len(data) == SMALL.houses_per_variation * len(dev)
    assert {(inst.gold.family, inst.gold.variation) for inst in data} == dev
    for inst in data:
        gold = inst.gold
        assert (gold.family, gold.variation) in dev and gold.family not in cat.ood_tasks
        assert gold.score == 100
        assert len(inst.explorers) == SMALL.explorers_per_house
        assert all((e.family, e.variation, e.house) == (gold.family, gold.variation, gold.house)
                   for e in inst.episodes)
    misled = sum(inst.misled is not None for inst in data)
    assert 0.3 * len(data) < misled < 0.7 * len(data)  # misled_rate 0.5


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


def test_sequences_are_whole_episodes_of_the_collectors_prompts(data, builder):
    """Each sequence is one episode's tip request chat plus its hindsight tip; every step's prompt, as the
    collector builds it with that layout (tips kept in every turn), is a prefix of it, followed by the action
    and end of turn, a TARGET except for exploration episodes, whose actions are not imitated."""
    sequences = training_sequences(builder, data[:12], SMALL)
    by_kind = {k: [s for s in sequences if s[0] == k] for k in (TIP_FREE, WITH_TIPS, MISLED, EXPLORER)}
    assert len(by_kind[TIP_FREE]) == len(by_kind[WITH_TIPS]) == 12
    assert len(by_kind[MISLED]) == sum(inst.misled is not None for inst in data[:12])
    assert len(by_kind[EXPLORER]) == 12 * SMALL.explorers_per_house
    tok = builder.tokenizer
    eos = tok.eos_token_id
    gold = data[0].gold
    for (_, ids, kinds), tips in ((by_kind[TIP_FREE][0], None), (by_kind[WITH_TIPS][0], "from the chat")):
        text = tok.decode(ids)
        if tips:  # the collector's own block, the same in every turn
            block = text[text.index(TIP_HEADER):text.index("</tip>\n<|im_end|>") + len("</tip>\n")]
            tips = [line[len("<tip>"):-len("</tip>")] for line in block.splitlines()[1:]]
            assert block == format_tip_block(tips) and text.count(block) == len(gold.turns)
        else:
            assert TIP_HEADER not in text
        for t, (obs, action) in enumerate(gold.turns):
            prompt = builder.build(gold.task, gold.turns[:t], obs, tips, [tips] * t if tips else None).ids
            target = tok.encode(action, add_special_tokens=False) + [eos]
            assert ids[:len(prompt)] == prompt and ids[len(prompt):len(prompt) + len(target)] == target
            assert kinds[len(prompt):len(prompt) + len(target)] == [TARGET] * len(target)
        request = builder.build_tip_request(gold.task, gold.turns, gold.final_obs,
                                            history_tips=[tips] * len(gold.turns) if tips else None)
        assert ids[:len(request)] == request and tok.decode(ids[len(request):-1]) == hindsight_tip(gold)
        assert kinds[len(request):] == [TARGET] * (len(ids) - len(request)) and ids[-1] == eos
        assert kinds.count(TARGET) == len(ids) - len(request) + sum(
            len(tok.encode(a, add_special_tokens=False)) + 1 for _, a in gold.turns)
    _, ids, kinds = by_kind[EXPLORER][0]  # exploration: only the tip is learned
    explorer = data[0].explorers[0]
    assert kinds.count(IGNORED) == sum(len(tok.encode(a, add_special_tokens=False)) + 1 for _, a in explorer.turns)
    assert tok.decode([i for i, k in zip(ids, kinds) if k == TARGET][:-1]) == hindsight_tip(explorer)
    assert set(kinds) <= {CONTEXT, TARGET, IGNORED}


def test_a_layout_where_prompts_are_not_prefixes_of_the_chat_is_refused(data, builder):
    windowed = PromptBuilder(builder.tokenizer, max_prompt_tokens=2048, history_turns=1, max_request_tokens=2048)
    gold = next(inst.gold for inst in data if len(inst.gold.turns) > 2)
    with pytest.raises(RuntimeError, match="not a prefix of the episode chat"):
        episode_sequence(windowed, gold, None, TARGET)


def test_acting_on_a_wrong_tip_follows_it_then_recovers(data, builder):
    """A misled episode carries a tip that moves one sought thing to another room; its actions head for
    that room first (the label follows the tip, never contradicts it) and still win from there."""
    checked = 0
    for inst in data[:40]:
        if inst.misled is None:
            continue
        gold, misled = inst.gold, inst.misled
        moved = [(thing, room) for thing, room in gold.sightings.items() if f"{thing} in the {room}" not in
                 inst.wrong_tip]
        assert len(moved) == 1
        thing, true_room = moved[0]
        told = inst.wrong_tip.split(f"{thing} in the ")[1].split(",")[0].split(".")[0]
        assert told != true_room and misled.score == 100
        env = make_env("minisci", max_steps=100, **gold.house)
        env.reset(task=gold.family, variation=gold.variation)
        plan = Planner(env._world)
        plan.go(told)
        actions = [a for _, a in misled.turns]
        assert actions[:len(plan.actions)] == plan.actions  # straight to the room the tip names
        prompt = builder.build(gold.task, [], misled.turns[0][0], [inst.wrong_tip])
        assert prompt.has_tips and builder.tokenizer.decode(prompt.ids).count(inst.wrong_tip) == 1
        checked += 1
    assert checked >= 10


def _sought(ep):
    world, task = build(ep.family, ep.variation, Difficulty(**ep.house))
    return task.sought


def test_the_policy_is_built_once_and_loads_as_a_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("EMPO2_CACHE", str(tmp_path))
    logs = []
    path = ensure_minisci_tips(SMALL, log=logs.append)
    assert (path / "empo2_source.json").is_file() and path.name.startswith("minisci-tips-")
    assert ensure_minisci_tips(SMALL, log=logs.append) == path
    assert sum("building" in line for line in logs) == 1
    model, tok = _load_local(path, torch.float32)
    assert model.config.hidden_size == SMALL.hidden_size and tok.eos_token == "<|im_end|>"


def test_a_finished_build_is_found_in_the_cache_first_then_among_the_shipped_ones(tmp_path, monkeypatch):
    import empo2.prior as prior

    monkeypatch.setenv("EMPO2_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(prior, "SHIPPED", tmp_path / "shipped")
    name = prior.cache_dir(SMALL, "minisci-tips").name
    assert prior.ready_path("minisci-tips", SMALL) is None
    (tmp_path / "shipped" / name).mkdir(parents=True)
    assert prior.ready_path("minisci-tips", SMALL) is None  # unfinished: no record written last
    (tmp_path / "shipped" / name / "empo2_source.json").write_text("{}")
    assert prior.ready_path("minisci-tips", SMALL) == tmp_path / "shipped" / name
    other = prior.cache_dir(TipPriorSettings(epochs=0.02, hidden_size=32, num_layers=1),
                            "minisci-tips").name
    assert other != name  # a changed setting never picks up another build's copy
    cached = prior.cache_dir(SMALL, "minisci-tips")
    cached.mkdir(parents=True)
    (cached / "empo2_source.json").write_text("{}")
    assert prior.ready_path("minisci-tips", SMALL) == cached

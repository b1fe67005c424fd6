"""The `minisci-tips` policy's data: dev variations only, the collector's own prompts (tip blocks as the
collector formats them, the whole episode in the tip request), hindsight tips that say only what the
episode's observations showed, and a cache built once."""

import pytest
import torch

from empo2.envs.minisci import catalogue
from empo2.memory import TIP_HEADER, format_tip_block, sanitize_tip
from empo2.models import _load_local, build_bpe_tokenizer
from empo2.prior_tips import (
    TIP_FREE,
    TIP_REQUEST,
    WITH_TIPS,
    TipPriorSettings,
    dev_episodes,
    ensure_minisci_tips,
    hindsight_tip,
    tip_examples,
)
from empo2.rollout.prompts import PromptBuilder

SMALL = TipPriorSettings(epochs=0.01, hidden_size=32, num_layers=1, vocab_size=400)


@pytest.fixture(scope="module")
def data():
    return dev_episodes(SMALL)


@pytest.fixture(scope="module")
def builder(data):
    texts = [hindsight_tip(e) for gold, exps in data[:20] for e in (gold, *exps)]
    texts += [t for gold, _ in data[:20] for pair in gold.turns for t in pair]
    return PromptBuilder(build_bpe_tokenizer(texts, 400), max_prompt_tokens=512, history_turns=2,
                         max_request_tokens=2048)


def test_every_episode_is_of_a_dev_variation_and_gold_paths_win(data):
    cat = catalogue()
    dev = {(t, v) for t in cat.tasks() for v in cat.split(t, "dev")}
    # every in-distribution dev instance, in houses_per_variation house draws
    assert len(data) == SMALL.houses_per_variation * len(dev)
    assert {(gold.family, gold.variation) for gold, _ in data} == dev
    for gold, exps in data:
        assert (gold.family, gold.variation) in dev and gold.family not in cat.ood_tasks
        assert gold.score == 100
        assert len(exps) == SMALL.explorers_per_house
        assert all((e.family, e.variation, e.house) == (gold.family, gold.variation, gold.house) for e in exps)


def test_hindsight_tips_state_only_what_the_episode_observed(data):
    for gold, exps in data[::15]:
        for ep in (gold, *exps):
            tip = hindsight_tip(ep)
            assert sanitize_tip(tip) == tip  # one clean line, storable as is
            chat = "\n".join(obs for obs, _ in ep.turns) + "\n" + ep.final_obs
            for thing, room in ep.sightings.items():
                assert f"{thing} in the {room}" in tip
                assert thing in chat and room in chat  # the chat showed both
            assert f"Final score {ep.score}." in tip
            if ep.failed_focus:
                assert f"focus on {ep.failed_focus}" in [a for _, a in ep.turns]


def test_examples_are_the_collectors_prompts(data, builder):
    examples = tip_examples(builder, data[:12], SMALL)
    kinds = {k: [e for e in examples if e[0] == k] for k in (TIP_FREE, WITH_TIPS, TIP_REQUEST)}
    steps = sum(len(gold.turns) for gold, _ in data[:12])
    assert len(kinds[TIP_FREE]) == len(kinds[WITH_TIPS]) == steps
    assert len(kinds[TIP_REQUEST]) == 12 * (1 + SMALL.explorers_per_house)
    tok = builder.tokenizer
    gold = data[0][0]
    for t, (obs, action) in enumerate(gold.turns):  # tip-free acting: exactly the collector's prompt
        _, prompt, target = kinds[TIP_FREE][t]
        assert prompt == builder.build(gold.task, gold.turns[:t], obs).ids
        assert target[-1] == tok.eos_token_id and tok.decode(target[:-1]) == action
    with_tips = 0
    for _, prompt, _ in kinds[WITH_TIPS]:
        text = tok.decode(prompt)
        if TIP_HEADER in text:
            with_tips += 1
            block = text[text.index(TIP_HEADER):text.rindex("</tip>") + len("</tip>\n")]
            tips = [line[len("<tip>"):-len("</tip>")] for line in block.splitlines()[1:]]
            assert block == format_tip_block(tips)  # the collector's own block format
    assert with_tips == len(kinds[WITH_TIPS])
    _, request, target = kinds[TIP_REQUEST][0]  # the whole episode, whatever history_turns says
    assert request == builder.build_tip_request(gold.task, gold.turns, gold.final_obs)
    assert all(obs.strip() in tok.decode(request) for obs, _ in gold.turns)
    assert tok.decode(target[:-1]) == hindsight_tip(gold)


def test_the_policy_is_built_once_and_loads_as_a_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("EMPO2_CACHE", str(tmp_path))
    logs = []
    path = ensure_minisci_tips(SMALL, log=logs.append)
    assert (path / "empo2_source.json").is_file() and path.name.startswith("minisci-tips-")
    assert ensure_minisci_tips(SMALL, log=logs.append) == path
    assert sum("building" in line for line in logs) == 1
    model, tok = _load_local(path, torch.float32)
    assert model.config.hidden_size == SMALL.hidden_size and tok.eos_token == "<|im_end|>"

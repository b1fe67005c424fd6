"""The `minisci_bc` policy: cloned only from dev variations, on the collector's own prompts, and the
cloning loop learns; the cache is built once, atomically, and loads as a transformers checkpoint."""

import math
from dataclasses import replace

import pytest
import torch

from empo2.envs.minisci import catalogue
from empo2.models.io import build_bpe_tokenizer, build_tiny_model, load_local
from empo2.rollout.prompts import PromptBuilder
from recipes.minisci_priors.prior import (
    CONTEXT,
    IGNORED,
    SOFT,
    TARGET,
    BCSettings,
    _batch,
    behaviour_clone,
    clone_examples,
    clone_loss,
    ensure_minisci_bc,
    gold_episodes,
)

SMALL = BCSettings(houses_per_variation=1, epochs=0.02, hidden_size=32, num_layers=1, vocab_size=300)


@pytest.fixture(scope="module")
def episodes():
    return gold_episodes(SMALL)


def test_demonstrations_come_from_dev_variations_only(episodes):
    import random

    from empo2.envs import make_env
    from recipes.minisci_priors.prior import _houses

    cat = catalogue()
    dev = [(task, v) for task in cat.tasks() for v in cat.split(task, "dev")]
    assert len(episodes) == len(dev)  # one house per (in-distribution family, dev variation) here
    assert not any(task in cat.ood_tasks for task, _ in dev)
    rng = random.Random(SMALL.seed)  # the house draws gold_episodes makes, in its order
    houses = [_houses(rng, 1)[0] for _ in dev]
    for (task, variation), house, (description, turns) in list(zip(dev, houses, episodes))[::20]:
        assert variation not in cat.split(task, "train") + cat.split(task, "test")
        obs, info = make_env("minisci", **house).reset(task=task, variation=variation)
        assert (info["task_description"], obs) == (description, turns[0][0])  # that very instance


def test_examples_are_the_collectors_prompts_with_the_action_and_end_of_turn_as_target(episodes):
    tok = build_bpe_tokenizer(["go to kitchen focus on frog"] * 4, 300)
    builder = PromptBuilder(tok, max_prompt_tokens=512, history_turns=2)
    task, turns = episodes[0]
    examples = clone_examples(builder, [(task, turns)])
    assert len(examples) == len(turns)
    for t, ((ids, kinds), (obs, action)) in enumerate(zip(examples, turns)):
        prompt = builder.build(task, turns[:t], obs).ids
        target = ids[len(prompt):]
        assert ids[:len(prompt)] == prompt and set(kinds[:len(prompt)]) == {CONTEXT}
        assert kinds[len(prompt):] == [TARGET] * len(target) and target[-1] == tok.eos_token_id
        assert tok.decode(target[:-1]) == action


def test_batch_pads_and_keeps_each_positions_kind():
    ids, mask, kinds = _batch([([5, 6, 7, 8, 9], [0, 0, 0, 1, 1]), ([5, 8], [0, 1])], pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 8, 9], [5, 8, 0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert kinds.tolist() == [[0, 0, 0, 1, 1], [0, 1, -2, -2, -2]]


def test_clone_loss_against_hand_computed_values():
    """Uniform logits over 4 tokens except where they favour the next token: NLLs are log(4) or
    -log(e / (e + 3)); targets and context are averaged separately, padding and IGNORED never count."""
    ids = torch.tensor([[0, 1, 2, 3], [0, 2, 0, 0]])
    kinds = torch.tensor([[CONTEXT, CONTEXT, TARGET, IGNORED], [CONTEXT, TARGET, -2, -2]])
    logits = torch.zeros(2, 4, 4)
    logits[0, 1, 2] = 1.0  # position 1 predicts token 2 (a target) with logit 1
    logits[0, 0, 1] = 1.0  # position 0 predicts token 1 (context) with logit 1
    logits[0, 2, 0] = 50.0  # position 2 predicts token 3, IGNORED: a huge loss that must not count
    hit, flat = -math.log(math.e / (math.e + 3)), math.log(4)
    loss, target = clone_loss(logits, ids, kinds)
    assert target.item() == pytest.approx((hit + flat) / 2) and loss.item() == pytest.approx((hit + flat) / 2)
    loss, target = clone_loss(logits, ids, kinds, lm_weight=0.5)
    assert loss.item() == pytest.approx((hit + flat) / 2 + 0.5 * hit)  # context: position 0 only
    # as transformers scores labels when lm_weight is 0
    labels = torch.where(kinds == TARGET, ids, torch.full_like(ids, -100))
    hf = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 4), labels[:, 1:].reshape(-1))
    assert clone_loss(logits, ids, kinds)[0].item() == pytest.approx(hf.item())
    # a batch whose context is all IGNORED (self-played tip requests) scores its targets alone, never NaN
    no_context = torch.where(kinds == CONTEXT, torch.full_like(kinds, IGNORED), kinds)
    loss, target = clone_loss(logits, ids, no_context, lm_weight=0.5)
    assert loss.item() == pytest.approx((hit + flat) / 2) and target.item() == pytest.approx((hit + flat) / 2)


def test_soft_targets_are_cross_entropy_to_their_distribution_and_its_gradient_is_q_minus_p():
    """A SOFT position scores -sum p log q against its row of `soft`: a one-hot row is the TARGET NLL of that
    token; a row equal to the model's own softmax scores its entropy and has zero gradient (the logits' gradient
    is (q - p) / number scored); SOFT rows are averaged with TARGET tokens, in row-major order of their positions."""
    ids = torch.tensor([[0, 1, 2, 3], [0, 2, 1, 0]])
    logits = torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(0))
    hard = torch.tensor([[CONTEXT, TARGET, TARGET, TARGET], [CONTEXT, TARGET, TARGET, -2]])
    soft_kinds = torch.tensor([[CONTEXT, TARGET, SOFT, SOFT], [CONTEXT, SOFT, TARGET, -2]])
    one_hot = torch.nn.functional.one_hot(torch.tensor([2, 3, 2]), 4).float()  # rows: (0, 2), (0, 3), (1, 1)
    assert clone_loss(logits, ids, soft_kinds, soft=one_hot)[1].item() == pytest.approx(
        clone_loss(logits, ids, hard)[1].item())
    q = torch.softmax(logits[:, :-1], dim=-1)  # (B, T-1, V): position t predicts token t + 1
    own = torch.stack([q[0, 1], q[0, 2], q[1, 0]])
    nll_target = [-math.log(q[0, 0, 1].item()), -math.log(q[1, 1, 1].item())]
    entropy = [-(r * r.log()).sum().item() for r in own]
    leaf = logits.clone().requires_grad_(True)
    loss, _ = clone_loss(leaf, ids, soft_kinds, soft=own)
    assert loss.item() == pytest.approx((sum(nll_target) + sum(entropy)) / 5, rel=1e-5)
    loss.backward()
    assert torch.allclose(leaf.grad[0, 2], torch.zeros(4), atol=1e-6)  # a SOFT position at its own distribution
    expected = (q[0, 0] - torch.nn.functional.one_hot(torch.tensor(1), 4)) / 5  # a TARGET position: (q - p) / 5
    assert torch.allclose(leaf.grad[0, 0], expected, atol=1e-6)
    # a batch with a distilled example trains through behaviour_clone beside hard ones
    model = build_tiny_model(build_bpe_tokenizer(["a b c d e f"], 270), 0, hidden_size=32, num_layers=1,
                             num_heads=2)
    probs = torch.softmax(torch.randn(2, model.config.vocab_size), dim=-1)
    examples = [([5, 6, 7, 8], [CONTEXT, CONTEXT, TARGET, TARGET]),
                ([5, 6, 7, 9], [IGNORED, IGNORED, SOFT, SOFT], probs)]
    stats = behaviour_clone(model, examples, BCSettings(epochs=2, batch_size=2), pad_id=0, log=lambda _: None)
    assert stats["steps"] == 2 and math.isfinite(stats["final_loss"])


def test_an_auxiliary_loss_trains_its_head_beside_the_clone_and_a_zero_one_changes_nothing():
    """`behaviour_clone(auxiliary=...)`: the auxiliary loss is added each step and its parameters are trained with
    the model; an auxiliary that is identically zero leaves the clone's update exactly as without one."""
    tok = build_bpe_tokenizer(["a b c d e f"], 270)
    examples = [([5, 6, 7, 8], [CONTEXT, CONTEXT, TARGET, TARGET]), ([5, 7, 6, 9], [CONTEXT, TARGET, TARGET, TARGET])]
    settings = BCSettings(epochs=3, batch_size=2)

    def trained(auxiliary=None, params=()):
        model = build_tiny_model(tok, 0, hidden_size=32, num_layers=1, num_heads=2)
        stats = behaviour_clone(model, examples, settings, pad_id=0, log=lambda _: None, auxiliary=auxiliary,
                                auxiliary_params=params)
        return model, stats

    plain, stats = trained()
    assert "final_auxiliary_loss" not in stats
    head = torch.nn.Parameter(torch.ones(3))
    zero, _ = trained(lambda: 0.0 * head.sum(), [head])
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), zero.state_dict().values(),
                                                    strict=True))
    target = torch.tensor([2.0, -1.0, 0.5])
    calls = []

    def auxiliary():
        calls.append(1)
        return (head - target).square().sum()

    _, stats = trained(auxiliary, [head])
    assert len(calls) == stats["steps"] == 3
    assert stats["final_auxiliary_loss"] > 0 and not torch.equal(head.detach(), torch.ones(3))
    # each coordinate moved towards its target (AdamW's first steps move every coordinate by about lr)
    assert ((head.detach() - torch.ones(3)).sign() == (target - torch.ones(3)).sign()).all()


def test_cloning_fits_a_handful_of_demonstrations(episodes):
    tok = build_bpe_tokenizer([t for _, turns in episodes[:8] for pair in turns for t in pair], 400)
    builder = PromptBuilder(tok, max_prompt_tokens=512, history_turns=2)
    examples = clone_examples(builder, episodes[:1])
    model = build_tiny_model(tok, seed=0, hidden_size=64, num_layers=1)
    ids, mask, kinds = _batch(examples, tok.pad_token_id)
    with torch.no_grad():
        before = clone_loss(model(input_ids=ids, attention_mask=mask).logits, ids, kinds)[0].item()
    settings = replace(SMALL, epochs=120, batch_size=len(examples), lr=1e-2)
    stats = behaviour_clone(model, examples, settings, tok.pad_token_id, log=lambda _: None)
    with torch.no_grad():
        after = clone_loss(model(input_ids=ids, attention_mask=mask).logits, ids, kinds)[0].item()
    assert stats["steps"] == 120
    assert after < 0.1 * before, (before, after)
    seq, kinds0 = examples[0]  # greedy decoding now reproduces a demonstrated action
    prompt, target = seq[:kinds0.index(TARGET)], seq[kinds0.index(TARGET):]
    out = model.generate(torch.tensor([prompt]), max_new_tokens=len(target), do_sample=False)
    assert out[0, len(prompt):].tolist() == target


def test_the_clone_is_built_once_and_loads_as_a_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("EMPO2_CACHE", str(tmp_path))
    logs = []
    path = ensure_minisci_bc(SMALL, log=logs.append)
    assert (path / "empo2_source.json").is_file() and path.parent == tmp_path / "models"
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".tmp-")]
    assert ensure_minisci_bc(SMALL, log=logs.append) == path
    assert sum("building" in line for line in logs) == 1
    model, tok = load_local(path, torch.float32)
    assert model.config.hidden_size == SMALL.hidden_size and tok.eos_token == "<|im_end|>"


def test_length_bucketed_passes_visit_every_example_once_with_less_padding():
    import random

    from recipes.minisci_priors.prior import _epoch_order

    lengths = [random.Random(i).randint(10, 900) for i in range(500)]
    plain = _epoch_order(random.Random(0), lengths, 32, by_length=False)
    bucketed = _epoch_order(random.Random(0), lengths, 32, by_length=True)
    assert sorted(plain) == sorted(bucketed) == list(range(500))

    def padded(order):
        return sum(max(lengths[i] for i in order[b:b + 32]) * len(order[b:b + 32]) for b in range(0, 500, 32))

    assert padded(bucketed) < 0.7 * padded(plain)

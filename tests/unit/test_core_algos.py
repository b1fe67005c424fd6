"""Checks of the EMPO² algorithm math: hand-computed cases, invariances, loop references, gradients."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from empo2.algo import core_algos as ca

EPS = 1e-6


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------------------------
# loop references (deliberately naive: one Python loop per sample / token)
# ----------------------------------------------------------------------------------------------


def ref_group_advantages(returns, group_ids, normalize_std=True, eps=EPS):
    returns, group_ids = returns.tolist(), group_ids.tolist()
    out = []
    for r, g in zip(returns, group_ids):
        members = [x for x, h in zip(returns, group_ids) if h == g]
        if len(members) < 2 or max(members) == min(members):
            out.append(0.0)
            continue
        adv = r - statistics.fmean(members)
        out.append(adv / (statistics.stdev(members) + eps) if normalize_std else adv)
    return torch.tensor(out, dtype=torch.float64)


def ref_policy_loss(lp, old, adv, mask, clip_low, clip_high, dual_c, agg):
    per_seq = []  # list of kept per-token losses per sample
    for b in range(lp.shape[0]):
        seq = []
        for t in range(lp.shape[1]):
            if not mask[b, t]:
                continue
            a = float(adv[b]) if adv.dim() == 1 else float(adv[b, t])
            ratio = math.exp(min(max(float(lp[b, t]) - float(old[b, t]), -20.0), 20.0))
            loss = max(-a * ratio, -a * min(max(ratio, 1 - clip_low), 1 + clip_high))
            if dual_c is not None and a < 0:
                loss = min(loss, -a * dual_c)
            seq.append(loss)
        per_seq.append(seq)
    nonempty = [s for s in per_seq if s]
    if agg == "token-mean":
        n = sum(len(s) for s in per_seq)
        return sum(sum(s) for s in per_seq) / n if n else 0.0
    if agg == "seq-mean-token-mean":
        return sum(sum(s) / len(s) for s in nonempty) / len(nonempty) if nonempty else 0.0
    return sum(sum(s) for s in nonempty) / len(nonempty) if nonempty else 0.0


# ----------------------------------------------------------------------------------------------
# group_advantages
# ----------------------------------------------------------------------------------------------


def test_group_advantages_two_groups_by_hand():
    # groups are interleaved and have non-contiguous ids 5 and 7
    returns = torch.tensor([1.0, 10.0, 2.0, 14.0, 3.0])
    ids = torch.tensor([5, 7, 5, 7, 5])
    # group 5: [1, 2, 3], mean 2, unbiased var (1 + 0 + 1) / 2 = 1, std 1 -> [-1, 0, 1] / (1 + eps)
    # group 7: [10, 14], mean 12, unbiased var (4 + 4) / 1 = 8, std 2.828427 -> [-2, 2] / 2.828427
    s = 1.0 / (1.0 + EPS)
    h = 2.0 / (math.sqrt(8.0) + EPS)  # 0.707107
    expected = torch.tensor([-s, -h, 0.0, h, s])
    torch.testing.assert_close(ca.group_advantages(returns, ids), expected, rtol=0, atol=1e-6)
    # without std normalisation: plain deviations from the group mean
    torch.testing.assert_close(
        ca.group_advantages(returns, ids, normalize_std=False), torch.tensor([-1.0, -2.0, 0.0, 2.0, 1.0])
    )


def test_group_advantages_degenerate_groups_are_exactly_zero():
    # a group of one (id -3), and a group of equal returns whose float64 mean is not exact:
    # (0.1 + 0.1 + 0.1) / 3 = 0.10000000000000002, so a naive R_i - mean leaves -1.4e-17 / eps
    returns = torch.tensor([4.0, 0.1, 0.1, 0.1, 1.0, 3.0], dtype=torch.float64)
    ids = torch.tensor([-3, 2, 2, 2, 9, 9])
    for normalize_std in (True, False):
        adv = ca.group_advantages(returns, ids, normalize_std=normalize_std)
        assert adv[:4].tolist() == [0.0, 0.0, 0.0, 0.0]
        assert adv[4] < 0 < adv[5]
    assert ca.group_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long)).shape == (0,)


@pytest.mark.parametrize("seed", range(4))
def test_group_advantages_matches_loop_reference(seed):
    g = _gen(seed)
    n = int(torch.randint(1, 13, (1,), generator=g))
    returns = torch.randn(n, generator=g, dtype=torch.float64)
    returns[: n // 3] = 1.5  # some ties, sometimes a whole tied group
    ids = torch.randint(-2, 4, (n,), generator=g) * 11
    for normalize_std in (True, False):
        torch.testing.assert_close(
            ca.group_advantages(returns, ids, normalize_std=normalize_std),
            ref_group_advantages(returns, ids, normalize_std=normalize_std),
            rtol=1e-6,
            atol=1e-6,
        )


def test_group_advantages_permutation_equivariant():
    g = _gen(0)
    returns = torch.randn(12, generator=g)
    ids = torch.randint(0, 3, (12,), generator=g)
    perm = torch.randperm(12, generator=g)
    torch.testing.assert_close(
        ca.group_advantages(returns[perm], ids[perm]), ca.group_advantages(returns, ids)[perm]
    )


def test_group_advantages_shift_and_scale_invariance():
    g = _gen(1)
    returns = torch.randn(9, generator=g, dtype=torch.float64)
    ids = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    shift = torch.tensor([3.0, -7.0, 100.0], dtype=torch.float64)[ids]  # a different constant per group
    base = ca.group_advantages(returns, ids)
    torch.testing.assert_close(ca.group_advantages(returns + shift, ids), base)
    torch.testing.assert_close(
        ca.group_advantages(returns + shift, ids, normalize_std=False),
        ca.group_advantages(returns, ids, False),
    )
    # scaling changes only the eps term: (a x) / (a s + eps) vs x / (s + eps)
    torch.testing.assert_close(ca.group_advantages(5.0 * returns, ids), base, rtol=1e-5, atol=1e-5)
    # without std normalisation the advantages scale with the returns
    torch.testing.assert_close(
        ca.group_advantages(5.0 * returns, ids, normalize_std=False),
        5.0 * ca.group_advantages(returns, ids, False),
    )


def test_group_advantages_dtypes():
    ids = torch.tensor([0, 0, 1, 1])
    r = torch.tensor([1.0, 2.0, 3.0, 5.0])
    assert ca.group_advantages(r.bfloat16(), ids).dtype == torch.float32
    assert ca.group_advantages(r.double(), ids).dtype == torch.float64
    with pytest.raises(ValueError, match="integer"):
        ca.group_advantages(r, ids.float())
    with pytest.raises(ValueError, match="shape"):
        ca.group_advantages(r, ids[:3])


# ----------------------------------------------------------------------------------------------
# intrinsic reward and return mixing
# ----------------------------------------------------------------------------------------------


def test_count_bonus_and_mix_returns_by_hand():
    torch.testing.assert_close(ca.count_bonus(torch.tensor([1, 2, 4])), torch.tensor([1.0, 0.5, 0.25]))
    assert ca.count_bonus(torch.tensor([0])).tolist() == [1.0]  # clamped: never inf
    # R = R_ext + beta * sum r_int: 1 + 0.5 * 2 = 2, 0 + 0.5 * 0.5 = 0.25
    mixed = ca.mix_returns(torch.tensor([1.0, 0.0]), torch.tensor([2.0, 0.5]), beta=0.5)
    torch.testing.assert_close(mixed, torch.tensor([2.0, 0.25]))
    with pytest.raises(ValueError, match="beta"):
        ca.mix_returns(torch.zeros(2), torch.zeros(2), beta=-0.1)


def test_retrieval_bonus_by_hand():
    # released code: 1/(count+1) on memory-mode steps (count 0 -> 1), 0 where tips were off
    retrieved = torch.tensor([0, 1, 9, 3, 10])
    mode = torch.tensor([True, True, True, False, True])
    torch.testing.assert_close(ca.retrieval_bonus(retrieved, mode),
                               torch.tensor([1.0, 0.5, 0.1, 0.0, 1 / 11], dtype=torch.float64))
    assert ca.retrieval_bonus(torch.tensor([-1]), torch.tensor([False])).tolist() == [0.0]  # ignored off-memory
    with pytest.raises(ValueError, match=">= 0"):
        ca.retrieval_bonus(torch.tensor([-1]), torch.tensor([True]))
    with pytest.raises(ValueError, match="shape"):
        ca.retrieval_bonus(torch.tensor([1, 2]), torch.tensor([True]))


def test_intrinsic_reward_reaches_the_advantage():
    ext = torch.tensor([1.0, 1.0, 1.0, 1.0])  # one group, all successes: no extrinsic signal
    ids = torch.zeros(4, dtype=torch.long)
    counts = torch.tensor([[1, 1, 1], [1, 2, 4], [3, 3, 3], [1, 1, 2]])  # (R, S) visit counts
    isum = ca.count_bonus(counts).sum(dim=-1)  # [3, 1.75, 1, 2.5]
    # beta = 0: exactly the extrinsic-only advantages (all zero here)
    assert torch.equal(
        ca.group_advantages(ca.mix_returns(ext, isum, 0.0), ids), ca.group_advantages(ext, ids)
    )
    # beta > 0: novelty differences must show up in the advantages, most novel trajectory first
    adv = ca.group_advantages(ca.mix_returns(ext, isum, 0.5), ids)
    assert not torch.equal(adv, ca.group_advantages(ext, ids))
    assert adv.argsort().tolist() == [2, 1, 3, 0]


def test_beta_schedule():
    assert ca.beta_at(0, 100, 0.8, 0.2) == pytest.approx(0.8)
    assert ca.beta_at(50, 100, 0.8, 0.2) == pytest.approx(0.5)  # 0.8 + (0.2 - 0.8) * 0.5
    assert ca.beta_at(100, 100, 0.8, 0.2) == pytest.approx(0.2)
    assert ca.beta_at(500, 100, 0.8, 0.2) == pytest.approx(0.2)  # stays at the end value
    assert ca.beta_at(3, 0, 0.8, 0.2) == pytest.approx(0.2)  # no horizon: already finished
    assert ca.beta_at(50, 100, 0.8, 0.2, schedule="constant") == 0.8
    with pytest.raises(ValueError, match="schedule"):
        ca.beta_at(0, 10, 0.8, 0.2, schedule="cosine")
    with pytest.raises(ValueError, match="step"):
        ca.beta_at(-1, 10, 0.8, 0.2)


# ----------------------------------------------------------------------------------------------
# hybrid rollout / update modes
# ----------------------------------------------------------------------------------------------


def test_memory_modes_extremes_and_frequency():
    assert not ca.draw_memory_modes(50, 20, 0.0, "step", _gen(0)).any()
    assert ca.draw_memory_modes(50, 20, 1.0, "step", _gen(0)).all()
    modes = ca.draw_memory_modes(200, 50, 0.3, "step", _gen(0))
    assert modes.shape == (200, 50) and modes.dtype == torch.bool
    assert abs(modes.float().mean().item() - 0.3) < 0.03  # 10k draws: std ~0.005


def test_memory_modes_granularity_and_reproducibility():
    episode = ca.draw_memory_modes(64, 5, 0.5, "episode", _gen(1))
    assert (episode == episode[:, :1]).all()  # constant along steps
    assert episode[:, 0].any() and not episode[:, 0].all()  # but differs between trajectories
    step = ca.draw_memory_modes(64, 5, 0.5, "step", _gen(1))
    assert not (step == step[:, :1]).all()
    batches = [ca.draw_memory_modes(4, 3, 0.5, "batch", _gen(s)) for s in range(20)]
    assert all(b.all() or not b.any() for b in batches)  # one draw for everything
    assert {bool(b.all()) for b in batches} == {True, False}
    assert torch.equal(
        ca.draw_memory_modes(8, 4, 0.5, "step", _gen(7)), ca.draw_memory_modes(8, 4, 0.5, "step", _gen(7))
    )


def test_update_modes_respect_memory_mask_and_q():
    memory = ca.draw_memory_modes(64, 6, 0.5, "step", _gen(2))
    for gran in ca.GRANULARITIES:
        assert not ca.draw_update_modes(memory, 0.0, gran, _gen(3)).any()  # q=0: never off-policy
        assert torch.equal(ca.draw_update_modes(memory, 1.0, gran, _gen(3)), memory)
        off = ca.draw_update_modes(memory, 0.5, gran, _gen(3))
        assert not (off & ~memory).any()  # off-policy only for memory-augmented samples
    # episode granularity: every memory step of a trajectory shares its draw
    full = torch.ones(64, 6, dtype=torch.bool)
    off = ca.draw_update_modes(full, 0.5, "episode", _gen(4))
    assert (off == off[:, :1]).all() and off.any() and not off.all()
    batch = ca.draw_update_modes(memory, 0.5, "batch", _gen(5))
    assert torch.equal(batch, memory) or not batch.any()
    # p = 0 never yields a memory mode, hence never an off-policy sample
    none = ca.draw_memory_modes(10, 4, 0.0, "episode", _gen(6))
    assert not ca.draw_update_modes(none, 1.0, "episode", _gen(6)).any()


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: ca.draw_memory_modes(2, 2, 1.5, "step", _gen(0)), "p must"),
        (lambda: ca.draw_memory_modes(2, 2, -0.1, "step", _gen(0)), "p must"),
        (lambda: ca.draw_memory_modes(2, 2, 0.5, "turn", _gen(0)), "granularity"),
        (lambda: ca.draw_update_modes(torch.ones(2, 2, dtype=torch.bool), 2.0, "step", _gen(0)), "q must"),
        (lambda: ca.draw_update_modes(torch.ones(2, 2), 0.5, "step", _gen(0)), "bool"),
    ],
)
def test_mode_draw_validation(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ----------------------------------------------------------------------------------------------
# masks
# ----------------------------------------------------------------------------------------------


def test_low_prob_mask_by_hand():
    # delta = 0.01 -> log(delta) = -4.60517; -4.6 passes (p = 0.01005), -5 fails (p = 0.0067)
    nan = float("nan")
    lp = torch.tensor([[-1.0, -5.0, -0.1, nan], [-0.5, -4.6, -100.0, -100.0]])
    valid = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    token = ca.low_prob_mask(lp, valid, 0.01, mode="token")
    assert token.tolist() == [[True, False, True, False], [True, True, False, False]]
    seq = ca.low_prob_mask(lp, valid, 0.01, mode="sequence")  # padding values (-100, nan) are ignored
    assert seq.tolist() == [[False] * 4, [True, True, False, False]]
    # delta = 0 keeps every valid token, even impossible ones
    lp[0, 1] = -math.inf
    for mode in ("token", "sequence"):
        assert torch.equal(ca.low_prob_mask(lp, valid, 0.0, mode=mode), valid.bool())


@pytest.mark.parametrize("seed", range(3))
def test_low_prob_mask_matches_loop_reference(seed):
    g = _gen(seed)
    b, t = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 7, (1,), generator=g))
    lp = -torch.rand(b, t, generator=g) * 6
    valid = torch.rand(b, t, generator=g) < 0.7
    delta = 0.05
    for mode in ("token", "sequence"):
        got = ca.low_prob_mask(lp, valid, delta, mode=mode)
        for i in range(b):
            seq_ok = all(math.exp(lp[i, j]) >= delta for j in range(t) if valid[i, j])
            for j in range(t):
                ok = math.exp(lp[i, j]) >= delta if mode == "token" else seq_ok
                assert bool(got[i, j]) == (bool(valid[i, j]) and ok)


def test_low_prob_mask_validation():
    lp, valid = torch.zeros(1, 2), torch.ones(1, 2)
    for delta in (-0.1, 1.0):
        with pytest.raises(ValueError, match="delta"):
            ca.low_prob_mask(lp, valid, delta)
    with pytest.raises(ValueError, match="mode"):
        ca.low_prob_mask(lp, valid, 0.1, mode="word")


def test_empo2_loss_mask_scopes():
    valid = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1]])
    lp = torch.tensor([[-9.0, -0.1, -9.0], [-9.0, -0.1, -0.1], [-0.1, -0.1, -0.1]])  # -9: p < 0.01
    offpolicy = torch.tensor([True, False, True])
    mask = ca.empo2_loss_mask(valid, lp, offpolicy, delta=0.01)
    # off-policy row 0 loses its low-prob token; on-policy row 1 keeps it (paper default)
    assert mask.tolist() == [[False, True, False], [True, True, True], [True, True, True]]
    mask_all = ca.empo2_loss_mask(valid, lp, offpolicy, delta=0.01, scope="all")
    assert mask_all.tolist() == [[False, True, False], [False, True, True], [True, True, True]]
    mask_seq = ca.empo2_loss_mask(valid, lp, offpolicy, delta=0.01, mode="sequence")
    assert mask_seq.tolist() == [[False, False, False], [True, True, True], [True, True, True]]
    with pytest.raises(ValueError, match="scope"):
        ca.empo2_loss_mask(valid, lp, offpolicy, delta=0.01, scope="onpolicy")
    with pytest.raises(ValueError, match="offpolicy"):
        ca.empo2_loss_mask(valid, lp, offpolicy[:2], delta=0.01)


# ----------------------------------------------------------------------------------------------
# policy loss
# ----------------------------------------------------------------------------------------------


def _hand_case():
    # old log-probs 0, so ratio = exp(logprobs); token (0, 2) is a valid token removed by the loss mask
    ratios = torch.tensor([[1.1, 1.5, math.exp(-30.0)], [0.5, 20.0, 1.0]])
    lp = ratios.log().requires_grad_()
    old = torch.zeros(2, 3)
    adv = torch.tensor([1.0, -1.0])
    loss_mask = torch.tensor([[True, True, False], [True, True, True]])
    return lp, old, adv, loss_mask


def test_policy_loss_by_hand():
    lp, old, adv, loss_mask = _hand_case()
    loss, m = ca.policy_loss(lp, old, adv, loss_mask, response_mask=torch.ones(2, 3, dtype=torch.bool))
    # A = +1:  ratio 1.1 in [0.8, 1.3]          -> l = -1.1
    #          ratio 1.5 > 1.3: max(-1.5, -1.3)  -> l = -1.3   (clipped)
    # A = -1:  ratio 0.5 < 0.8: max(0.5, 0.8)    -> l =  0.8   (clipped)
    #          ratio 20: max(20, 1.3) = 20, min(20, 10) -> l = 10 (dual clip)
    #          ratio 1.0                         -> l =  1.0
    # token-mean over the 6 valid tokens (the masked one counts as a zero-loss token):
    # (-1.1 - 1.3 + 0.8 + 10 + 1) / 6 = 9.4 / 6 = 1.5667
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(9.4 / 6, abs=1e-6)
    assert m["clip_frac"] == pytest.approx(2 / 5)
    assert m["dual_clip_frac"] == pytest.approx(1 / 5)
    assert m["ratio_mean"] == pytest.approx((1.1 + 1.5 + 0.5 + 20 + 1) / 5, rel=1e-6)  # 4.82
    # k3 = r - 1 - log r: 0.0046898 + 0.0945349 + 0.1931472 + 16.0042677 + 0 = 16.2966396 -> / 5
    assert m["approx_kl"] == pytest.approx(16.2966396 / 5, rel=1e-5)
    assert m["masked_frac"] == pytest.approx(1 / 6)  # 1 of 6 valid response tokens removed
    loss.backward()
    # d l / d logprob = -A * ratio on unclipped tokens, 0 where clipped, dual-clipped or masked; / 6 tokens
    expected_grad = torch.tensor([[-1.1 / 6, 0.0, 0.0], [0.0, 0.0, 1.0 / 6]])
    torch.testing.assert_close(lp.grad, expected_grad)
    assert lp.grad[0, 2].item() == 0.0 and lp.grad[0, 1].item() == 0.0 and lp.grad[1, 1].item() == 0.0


def test_policy_loss_aggregation_and_dual_clip_switch_by_hand():
    lp, old, adv, loss_mask = _hand_case()
    # per sequence: seq 0 kept losses [-1.1, -1.3], seq 1 kept losses [0.8, 10, 1]
    loss, _ = ca.policy_loss(lp, old, adv, loss_mask, agg="seq-mean-token-mean")
    assert loss.item() == pytest.approx((-2.4 / 2 + 11.8 / 3) / 2, abs=1e-6)  # (-1.2 + 3.9333) / 2 = 1.3667
    loss, _ = ca.policy_loss(lp, old, adv, loss_mask, agg="seq-mean-token-sum")
    assert loss.item() == pytest.approx((-2.4 + 11.8) / 2, abs=1e-6)  # 4.7
    # dual clip off: the ratio-20 token keeps l = 20 -> (9.4 - 10 + 20) / 5 = 3.88
    loss, m = ca.policy_loss(lp, old, adv, loss_mask, dual_clip_c=None)
    assert loss.item() == pytest.approx(3.88, abs=1e-5)
    assert m["dual_clip_frac"] == 0.0
    assert ca.policy_loss(lp, old, adv, loss_mask)[1]["masked_frac"] == 0.0  # no response_mask given
    # with the response mask, the masked token of seq 0 counts in its denominators: (-2.4 / 3 + 11.8 / 3) / 2
    valid = torch.ones(2, 3, dtype=torch.bool)
    loss, _ = ca.policy_loss(lp, old, adv, loss_mask, agg="seq-mean-token-mean", response_mask=valid)
    assert loss.item() == pytest.approx((-2.4 / 3 + 11.8 / 3) / 2, abs=1e-6)  # 1.5667


def test_policy_loss_asymmetric_clip():
    lp = torch.tensor([[math.log(1.25)]])
    one = torch.ones(1, 1, dtype=torch.bool)
    # A = 1, ratio 1.25: inside [0.8, 1.3] -> -1.25; with a symmetric 0.2 clip -> max(-1.25, -1.2) = -1.2
    assert ca.policy_loss(lp, torch.zeros(1, 1), torch.ones(1), one)[0].item() == pytest.approx(-1.25)
    assert ca.policy_loss(lp, torch.zeros(1, 1), torch.ones(1), one, clip_high=0.2)[
        0
    ].item() == pytest.approx(-1.2)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("agg", ca.AGG_MODES)
def test_policy_loss_matches_loop_reference(seed, agg):
    g = _gen(seed)
    b, t = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 7, (1,), generator=g))
    lp = torch.randn(b, t, generator=g) * 0.6 - 1.0
    old = torch.randn(b, t, generator=g) * 0.6 - 1.0
    adv = torch.randn(b, generator=g) if seed % 2 else torch.randn(b, t, generator=g)
    mask = torch.rand(b, t, generator=g) < 0.6
    dual_c = None if seed == 3 else 3.0  # small constant so the dual clip actually binds
    clip_low, clip_high = 0.1, 0.25
    loss, _ = ca.policy_loss(lp, old, adv, mask, clip_low, clip_high, dual_c, agg)
    expected = ref_policy_loss(lp, old, adv, mask, clip_low, clip_high, dual_c, agg)
    torch.testing.assert_close(
        loss.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("agg", ca.AGG_MODES)
def test_policy_loss_ignores_values_at_masked_positions(agg):
    g = _gen(0)
    lp0, old0, adv0 = (
        torch.randn(3, 4, generator=g),
        torch.randn(3, 4, generator=g),
        torch.randn(3, 4, generator=g),
    )
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    nan, inf = float("nan"), float("inf")
    # in-range log-ratios (3 - -1 = 4) next to NaN advantages, and non-finite log-probs
    garbage_lp = torch.tensor([[0, 0, 3.0, 3.0], [0, 3.0, 0, nan], [inf, -inf, 1e30, 3.0]])
    garbage_old = torch.tensor([[0, 0, -1.0, -1.0], [0, -1.0, 0, 0], [-inf, 0, 0, nan]])
    garbage_adv = torch.tensor([[0, 0, nan, -inf], [0, inf, 0, nan], [nan, 1e30, nan, nan]])

    def run(lp_vals, old_vals, adv_vals):
        lp = lp_vals.clone().requires_grad_()
        loss, metrics = ca.policy_loss(lp, old_vals, adv_vals, mask, agg=agg)
        loss.backward()
        return loss, lp.grad, metrics

    clean = run(lp0, old0, adv0)
    dirty = run(
        torch.where(mask, lp0, garbage_lp),
        torch.where(mask, old0, garbage_old),
        torch.where(mask, adv0, garbage_adv),
    )
    assert torch.equal(clean[0], dirty[0])
    assert torch.equal(clean[1], dirty[1])
    assert clean[2] == dirty[2]
    assert (clean[1][~mask] == 0).all() and (clean[1][mask] != 0).any()


def test_policy_loss_all_masked_is_zero_with_zero_grad():
    lp = torch.randn(2, 3).requires_grad_()
    for agg in ca.AGG_MODES:
        loss, metrics = ca.policy_loss(
            lp,
            torch.randn(2, 3),
            torch.randn(2),
            torch.zeros(2, 3, dtype=torch.bool),
            agg=agg,
            response_mask=torch.zeros(2, 3),
        )
        assert loss.item() == 0.0
        loss.backward()
        assert torch.equal(lp.grad, torch.zeros(2, 3))
        assert all(v == 0.0 for v in metrics.values())
        lp.grad = None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_policy_loss_huge_log_ratios_stay_finite(dtype):
    # log-ratios of +-1e4 and +inf (an impossible behaviour token) hit the clamp at +-20
    lp = torch.tensor([[0.0, -1e4, 0.0], [0.0, -1e4, 0.0]], dtype=dtype).requires_grad_()
    old = torch.tensor([[-1e4, 0.0, -math.inf], [-1e4, 0.0, -math.inf]], dtype=dtype)
    adv = torch.tensor([1.0, -1.0], dtype=dtype)
    mask = torch.ones(2, 3, dtype=torch.bool)
    for dual_c in (10.0, None):
        loss, metrics = ca.policy_loss(lp, old, adv, mask, dual_clip_c=dual_c)
        assert loss.dtype == torch.float32 and torch.isfinite(loss)
        assert all(math.isfinite(v) for v in metrics.values())
        loss.backward()
        assert torch.isfinite(lp.grad).all()
        assert torch.equal(lp.grad, torch.zeros_like(lp.grad))  # clamped log-ratios pass no gradient
        lp.grad = None


def test_policy_loss_bfloat16_is_upcast():
    g = _gen(3)
    lp16 = (torch.randn(3, 5, generator=g) * 0.3 - 1).bfloat16().requires_grad_()
    old16 = (torch.randn(3, 5, generator=g) * 0.3 - 1).bfloat16()
    adv16 = torch.randn(3, generator=g).bfloat16()
    mask = torch.rand(3, 5, generator=g) < 0.8
    loss16, m16 = ca.policy_loss(lp16, old16, adv16, mask)
    lp32 = lp16.detach().float().requires_grad_()
    loss32, m32 = ca.policy_loss(lp32, old16.float(), adv16.float(), mask)
    assert loss16.dtype == torch.float32
    assert torch.equal(loss16, loss32)  # bf16 -> f32 is exact, so the float32 math is identical
    assert m16 == m32
    loss16.backward()
    loss32.backward()
    assert lp16.grad.dtype == torch.bfloat16
    torch.testing.assert_close(lp16.grad.float(), lp32.grad.bfloat16().float())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"clip_low": 1.0}, "clip_low"),
        ({"clip_high": -0.1}, "clip_high"),
        ({"dual_clip_c": 1.0}, "dual_clip_c"),
        ({"agg": "sum"}, "aggregation"),
        ({"advantages": torch.zeros(3)}, "advantages"),
        ({"loss_mask": torch.ones(2, 2)}, "shape"),
    ],
)
def test_policy_loss_validation(kwargs, match):
    args = {
        "logprobs": torch.zeros(2, 3),
        "old_logprobs": torch.zeros(2, 3),
        "advantages": torch.zeros(2),
        "loss_mask": torch.ones(2, 3),
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        ca.policy_loss(**args)


def test_agg_loss_modes_by_hand():
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), 0.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    # kept: row 0 [1, 2, 3], row 1 [4], row 2 nothing (excluded from the sequence means)
    assert ca.agg_loss(loss_mat, mask, "token-mean").item() == pytest.approx(10 / 4)  # 2.5
    assert ca.agg_loss(loss_mat, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)  # 3
    assert ca.agg_loss(loss_mat, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)  # 5
    with pytest.raises(ValueError, match="aggregation"):
        ca.agg_loss(loss_mat, mask, "mean")


def test_verl_token_mean_over_one_sample_micro_batches_is_seq_mean_token_mean():
    """The released code's update (verl 0.5.0 dp_actor.py:386-388, 466-469): each micro-batch of one sample takes
    token-mean, divided by the accumulation steps; over a mini-batch that is seq-mean-token-mean, not token-mean."""
    loss_mat = torch.tensor([[1.0, 2.0, 3.0, 6.0], [4.0, 0.0, 0.0, 0.0], [2.0, 8.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]])
    accumulated = sum(ca.agg_loss(loss_mat[i:i + 1], mask[i:i + 1], "token-mean") / 3 for i in range(3))
    # by hand: (12 / 4 + 4 / 1 + 10 / 2) / 3 = (3 + 4 + 5) / 3 = 4, where token-mean would give 26 / 7
    assert accumulated.item() == pytest.approx(4.0)
    assert ca.agg_loss(loss_mat, mask, "seq-mean-token-mean").item() == pytest.approx(4.0)
    assert ca.agg_loss(loss_mat, mask, "token-mean").item() == pytest.approx(26 / 7)


# ----------------------------------------------------------------------------------------------
# optional terms
# ----------------------------------------------------------------------------------------------


def test_kl_penalty_by_hand():
    lp = torch.tensor([[math.log(0.5), -1e4]], requires_grad=True)
    ref = torch.tensor([[math.log(0.25), 0.0]])
    # k1 = log 0.5 - log 0.25 = log 2 = 0.693147
    assert ca.kl_penalty(lp, ref, "k1")[0, 0].item() == pytest.approx(math.log(2), rel=1e-6)
    # k3: d = ref - lp = -log 2 -> exp(d) - d - 1 = 0.5 + 0.693147 - 1 = 0.193147
    k3 = ca.kl_penalty(lp, ref, "k3")
    assert k3[0, 0].item() == pytest.approx(0.5 + math.log(2) - 1, rel=1e-6)
    # d = 1e4 is clamped to 20: exp(20) - 21, finite
    assert k3[0, 1].item() == pytest.approx(math.exp(20) - 21, rel=1e-6)
    k3.sum().backward()
    assert torch.isfinite(lp.grad).all()
    g = _gen(0)
    assert (ca.kl_penalty(torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g), "k3") >= 0).all()
    with pytest.raises(ValueError, match="KL"):
        ca.kl_penalty(lp, ref, "k2")


def test_entropy_from_logits():
    torch.testing.assert_close(ca.entropy_from_logits(torch.zeros(1, 2, 5)), torch.full((1, 2), math.log(5)))
    # huge logits: a naive softmax/log would overflow; entropy of a near one-hot is ~0
    peaked = torch.tensor([[[1e4, 0.0, -1e4]]], dtype=torch.bfloat16, requires_grad=True)
    h = ca.entropy_from_logits(peaked)
    assert h.dtype == torch.float32 and h.item() == pytest.approx(0.0, abs=1e-6)
    h.sum().backward()
    assert torch.isfinite(peaked.grad).all()
    logits = torch.randn(3, 4, 7, generator=_gen(1))
    torch.testing.assert_close(
        ca.entropy_from_logits(logits), torch.distributions.Categorical(logits=logits).entropy()
    )



@pytest.mark.parametrize("mode", ca.AGG_MODES)
def test_agg_loss_of_micro_batches_sums_to_the_mini_batch_aggregate(mode):
    """Split-invariance: with the mini-batch's valid-token and response counts, micro-batch aggregates add
    up to the aggregate of the whole mini-batch, for any split and any loss mask inside the valid tokens."""
    g = torch.Generator().manual_seed(0)
    B, T = 7, 9
    lengths = torch.tensor([1, 9, 3, 6, 2, 8, 5])
    valid = torch.arange(T)[None, :] < lengths[:, None]  # (B, T)
    keep = valid & (torch.rand(B, T, generator=g) > 0.3)  # a delta-like mask drops ~30% of tokens
    keep[4] = False  # one response masked entirely
    loss_mat = torch.randn(B, T, generator=g).requires_grad_()
    whole = ca.agg_loss(loss_mat, keep, mode, valid)
    (grad_whole,) = torch.autograd.grad(whole, loss_mat)
    for bounds in ([0, 1, 2, 3, 4, 5, 6, 7], [0, 3, 7], [0, 5, 6, 7]):
        parts = [ca.agg_loss(loss_mat[a:b], keep[a:b], mode, valid[a:b], int(valid.sum()), B)
                 for a, b in zip(bounds[:-1], bounds[1:])]
        total = torch.stack(parts).sum()
        (grad,) = torch.autograd.grad(total, loss_mat)
        assert total.item() == pytest.approx(whole.item(), rel=1e-6)
        torch.testing.assert_close(grad, grad_whole)


def test_data_parallel_ranks_normalised_by_the_global_counts_and_averaged_give_the_global_aggregate_by_hand():
    """Two ranks of one mini-batch: rank 0 holds token losses [1, 2, 3] (one response), rank 1 [10] (one response).
    Normalised by the global counts (4 tokens, 2 responses), each rank's loss scaled by the 2 ranks and averaged (as
    DDP and FSDP2 reduce) is the union's aggregate; normalised by each rank's own counts it is not."""
    parts = [torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[10.0, 0.0, 0.0]])]
    valid = [torch.tensor([[True, True, True]]), torch.tensor([[True, False, False]])]
    by_hand = {"token-mean": 16 / 4, "seq-mean-token-mean": (2 + 10) / 2, "seq-mean-token-sum": (6 + 10) / 2}
    for mode, expected in by_hand.items():
        ranks = [2 * ca.agg_loss(m, v, mode, num_tokens=4, num_seqs=2) for m, v in zip(parts, valid)]
        assert (sum(ranks) / 2).item() == pytest.approx(expected)
    local = sum(ca.agg_loss(m, v, "token-mean") for m, v in zip(parts, valid)) / 2
    assert local.item() == pytest.approx((2 + 10) / 2)  # the mean of the ranks' token-means: rank 1's token weighs 3x


@pytest.mark.parametrize("mode", ca.AGG_MODES)
def test_data_parallel_gradient_with_global_counts_is_the_union_gradient_even_with_an_empty_rank(mode):
    """Any split of a mini-batch over ranks, uneven or leaving a rank nothing (its padding gives a zero loss): the mean
    of the ranks' gradients of world x agg_loss(rank part, global counts) is the gradient of the union's aggregate."""
    g = torch.Generator().manual_seed(1)
    B, T = 6, 8
    lengths = torch.tensor([8, 7, 6, 8, 1, 2])
    valid = torch.arange(T)[None, :] < lengths[:, None]  # (B, T)
    keep = valid & (torch.rand(B, T, generator=g) > 0.3)
    loss_mat = torch.randn(B, T, generator=g).requires_grad_()
    (grad_whole,) = torch.autograd.grad(ca.agg_loss(loss_mat, keep, mode, valid), loss_mat)
    for ranks in ([[0, 1, 2, 3], [4, 5]], [[0, 1, 2, 3, 4, 5], []], [[0], [1], [2, 3, 4, 5]]):
        world, grads = len(ranks), []
        for rows in ranks:  # each rank's backward of its scaled loss; a rank without a sample runs zero-weight padding
            weight, rows = (1.0, rows) if rows else (0.0, [0])
            part = ca.agg_loss(loss_mat[rows], keep[rows], mode, valid[rows], int(valid.sum()), B)
            grads += torch.autograd.grad(part * (weight * world), loss_mat)
        torch.testing.assert_close(torch.stack(grads).mean(0), grad_whole)  # the reduce averages over ranks


def test_agg_loss_counts_masked_tokens_as_zero_loss_tokens_by_hand():
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    valid = torch.tensor([[True, True, True], [True, False, False]])
    keep = torch.tensor([[True, False, True], [True, False, False]])
    assert ca.agg_loss(loss_mat, keep, "token-mean", valid).item() == pytest.approx((1 + 3 + 4) / 4)
    assert ca.agg_loss(loss_mat, keep, "seq-mean-token-mean", valid).item() == pytest.approx((4 / 3 + 4) / 2)
    assert ca.agg_loss(loss_mat, keep, "seq-mean-token-sum", valid).item() == pytest.approx((4 + 4) / 2)
    # one micro-batch of a mini-batch of 10 valid tokens and 4 responses
    assert ca.agg_loss(loss_mat, keep, "token-mean", valid, num_tokens=10).item() == pytest.approx(8 / 10)
    assert ca.agg_loss(loss_mat, keep, "seq-mean-token-sum", valid, num_seqs=4).item() == pytest.approx(8 / 4)


# ----------------------------------------------------------------------------------------------
# edges the mutation run (docs/testing.md) found unchecked
# ----------------------------------------------------------------------------------------------


def test_count_bonus_dtype_follows_float_counts_and_is_float32_otherwise():
    assert ca.count_bonus(torch.tensor([2, 0])).tolist() == [0.5, 1.0]
    assert ca.count_bonus(torch.tensor([2, 0])).dtype == torch.float32
    double = ca.count_bonus(torch.tensor([3.0], dtype=torch.float64))
    assert double.dtype == torch.float64 and double.item() == 1.0 / 3.0  # float64 all the way, not rounded
    half = ca.count_bonus(torch.tensor([3.0], dtype=torch.float16))  # promoted, so 1/3 to float32 precision
    assert half.dtype == torch.float32 and half.item() == torch.tensor(1.0 / 3.0, dtype=torch.float32).item()


@pytest.mark.parametrize("fn, args, shapes", [
    (ca.mix_returns, (torch.zeros(3), torch.zeros(2), 0.5), "{'ext_returns': (3,), 'intrinsic_sums': (2,)}"),
    (ca.low_prob_mask, (torch.zeros(2, 3), torch.ones(2, 4, dtype=torch.bool), 0.1),
     "{'logprobs': (2, 3), 'response_mask': (2, 4)}"),
    (ca.kl_penalty, (torch.zeros(2, 3), torch.zeros(3, 2)), "{'logprobs': (2, 3), 'ref_logprobs': (3, 2)}"),
    (ca.agg_loss, (torch.zeros(2, 3), torch.ones(2, 2)), "{'loss_mat': (2, 3), 'mask': (2, 2)}"),
    (lambda *a: ca.agg_loss(*a, response_mask=torch.ones(3, 3)), (torch.zeros(2, 3), torch.ones(2, 3)),
     "{'loss_mat': (2, 3), 'response_mask': (3, 3)}"),
])
def test_shape_mismatches_name_both_tensors(fn, args, shapes):
    with pytest.raises(ValueError) as e:
        fn(*args)
    assert str(e.value) == f"shape mismatch: {shapes}"


def test_beta_schedule_of_one_step_starts_at_start():
    assert ca.beta_at(0, 1, 0.8, 0.2) == 0.8 and ca.beta_at(1, 1, 0.8, 0.2) == pytest.approx(0.2)


def test_a_draw_of_exactly_zero_is_no_memory_at_p0(monkeypatch):
    """`rand` is in [0, 1): a draw of 0.0 can happen, and p=0 must still mean no memory at all."""
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.zeros(shape))
    assert not ca.draw_memory_modes(2, 3, 0.0, "step", _gen(0)).any()
    assert ca.draw_memory_modes(2, 3, 1e-9, "step", _gen(0)).all()


def test_empty_mode_draws_are_fine_and_negative_sizes_are_refused():
    assert ca.draw_memory_modes(0, 3, 0.5, "step", _gen(0)).shape == (0, 3)
    assert ca.draw_memory_modes(2, 0, 0.5, "step", _gen(0)).shape == (2, 0)
    for sizes in ((-1, 3), (3, -1)):
        with pytest.raises(ValueError, match=rf"sizes must be >= 0, got \({sizes[0]}, {sizes[1]}\)"):
            ca.draw_memory_modes(*sizes, 0.5, "step", _gen(0))


def test_defaults_are_the_token_mask_the_k1_estimator_and_the_token_mean():
    logprobs = torch.log(torch.tensor([[0.5, 0.01]]))  # the second token fails delta=0.1, the first passes
    valid = torch.ones(1, 2, dtype=torch.bool)
    assert ca.low_prob_mask(logprobs, valid, 0.1).tolist() == [[True, False]]  # token mode, not sequence
    ref = torch.tensor([[0.0, -1.0]])
    assert ca.kl_penalty(logprobs, ref).tolist() == ca.kl_penalty(logprobs, ref, "k1").tolist()
    # token-mean: (1 + 2 + 3) / 3 tokens = 2; the sequence means would give (1.5 + 3) / 2 or (3 + 3) / 2
    loss, mask = torch.tensor([[1.0, 2.0], [3.0, 0.0]]), torch.tensor([[True, True], [True, False]])
    assert ca.agg_loss(loss, mask).item() == 2.0


def test_k3_clamps_a_huge_log_ratio_at_20():
    # d = ref - logp = -30 is clamped to -20: exp(-20) + 20 - 1, not exp(-30) + 30 - 1
    out = ca.kl_penalty(torch.tensor([[0.0]]), torch.tensor([[-30.0]]), "k3")
    assert out.item() == pytest.approx(math.exp(-20.0) + 19.0, rel=1e-6)
    out = ca.kl_penalty(torch.tensor([[0.0]]), torch.tensor([[30.0]]), "k3")  # and from above: exp(20) - 21
    assert out.item() == pytest.approx(math.exp(20.0) - 21.0, rel=1e-6)


def test_given_counts_of_one_divide_by_one():
    # one valid token / one response in the whole mini-batch: the loss is that token's, not half of it
    loss, mask = torch.tensor([[3.0]]), torch.tensor([[True]])
    assert ca.agg_loss(loss, mask, "token-mean", num_tokens=1).item() == 3.0
    assert ca.agg_loss(loss, mask, "seq-mean-token-sum", num_seqs=1).item() == 3.0


def test_group_advantages_errors_name_the_problem():
    ids = torch.tensor([0, 0])
    with pytest.raises(ValueError, match=r"^returns must be 1-D \(R,\), got shape \(2, 2\)$"):
        ca.group_advantages(torch.zeros(2, 2), ids)
    with pytest.raises(ValueError, match=r"^group_ids must be an integer tensor, got torch.bool$"):
        ca.group_advantages(torch.zeros(2), torch.tensor([True, False]))
    with pytest.raises(ValueError, match=r"^eps must be >= 0, got -1.0$"):
        ca.group_advantages(torch.zeros(2), ids, eps=-1.0)
    assert ca.group_advantages(torch.tensor([1.0, 3.0]), ids, eps=0.0).tolist() == pytest.approx([-0.5 ** 0.5,
                                                                                                  0.5 ** 0.5])


def test_group_means_are_taken_in_float64():
    # 2^24 and 2^24 + 2 are float32 numbers, their float32 sum is not: the mean must come out as 2^24 + 1
    adv = ca.group_advantages(torch.tensor([16777216.0, 16777218.0]), torch.tensor([0, 0]))
    assert adv.tolist() == pytest.approx([-0.5 ** 0.5, 0.5 ** 0.5], rel=1e-5)


def test_equal_negative_returns_give_exactly_zero():
    # -0.1 three times has a mean that rounds off -0.1: only the max == min test makes these exactly 0
    returns = torch.tensor([-0.1, -0.1, -0.1], dtype=torch.float64)
    assert ca.group_advantages(returns, torch.tensor([0, 0, 0])).tolist() == [0.0, 0.0, 0.0]


# ----------------------------------------------------------------------------------------------
# The sampler/trainer gap: truncated importance sampling and its metrics
# ----------------------------------------------------------------------------------------------
def test_truncated_is_weights_by_hand():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.1, 7.0]])
    engine = torch.tensor([[-1.0, -2.5, -2.0], [-2.0, -0.1, -50.0]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    w = ca.truncated_is_weights(old, engine, valid, cap=2.0)
    # pi_old / pi_engine = exp(old - engine): exp(0) = 1, exp(0.5) = 1.6487, exp(1.5) = 4.48 -> 2 (truncated),
    # exp(-1) = 0.3679 (never raised), exp(0) = 1; padding -> 1 whatever it holds
    expected = torch.tensor([[1.0, math.exp(0.5), 2.0], [math.exp(-1.0), 1.0, 1.0]])
    torch.testing.assert_close(w, expected)
    assert not w.requires_grad
    # a huge log-ratio is truncated without overflowing
    assert ca.truncated_is_weights(torch.tensor([[0.0]]), torch.tensor([[-1e4]]), torch.ones(1, 1, dtype=bool),
                                   3.0).item() == 3.0
    # a truncated token weighs exactly the cap, which the truncated-fraction metric counts by (exp(log 7) < 7)
    for cap in (2.0, 3.0, 5.0, 7.0, 10.0):
        assert ca.truncated_is_weights(torch.tensor([[0.0]]), torch.tensor([[-20.0]]), torch.ones(1, 1, dtype=bool),
                                       cap).item() == cap
    with pytest.raises(ValueError, match="cap must be > 0"):
        ca.truncated_is_weights(old, engine, valid, cap=0.0)


def test_policy_loss_multiplies_each_tokens_loss_by_its_weight_by_hand():
    lp, old, adv, loss_mask = _hand_case()
    valid = torch.ones(2, 3, dtype=torch.bool)
    weights = torch.tensor([[0.5, 2.0, 1.0], [1.0, 1.0, 3.0]])
    loss, _ = ca.policy_loss(lp, old, adv, loss_mask, response_mask=valid, token_weights=weights)
    # the per-token losses of test_policy_loss_by_hand, (-1.1, -1.3, masked; 0.8, 10, 1.0), times the weights:
    # (-0.55 - 2.6 + 0.8 + 10 + 3) / 6
    assert loss.item() == pytest.approx(10.65 / 6, abs=1e-6)
    loss.backward()
    # the unclipped tokens' gradients scale with their weights (the weights are constants)
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.1 * 0.5 / 6, 0.0, 0.0], [0.0, 0.0, 3.0 / 6]]))
    lp.grad = None
    ones, _ = ca.policy_loss(lp, old, adv, loss_mask, response_mask=valid, token_weights=torch.ones(2, 3))
    assert ones.item() == pytest.approx(9.4 / 6, abs=1e-6)  # weight 1 is the plain loss


def test_logprob_gap_by_hand():
    old = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    engine = torch.tensor([-1.0, -2.5, -0.3, -3.0])
    gap = ca.logprob_gap(old, engine)
    # d = old - engine = (0, 0.5, -0.2, 0): |d| mean 0.7 / 4, max 0.5;
    # k3 = exp(d) - 1 - d: 0 + 0.1487213 + 0.0187308 + 0 -> / 4
    assert gap["mean"] == pytest.approx(0.175)
    assert gap["max"] == pytest.approx(0.5)
    assert gap["kl"] == pytest.approx((0.1487212707 + 0.0187307531) / 4, rel=1e-6)  # inputs in float32
    assert ca.logprob_gap(old, old) == {"mean": 0.0, "max": 0.0, "kl": 0.0}
    assert ca.logprob_gap(torch.zeros(0), torch.zeros(0)) == {"mean": 0.0, "max": 0.0, "kl": 0.0}


def test_logprob_gap_totals_combined_over_ranks_give_the_gap_of_all_their_tokens():
    """Data-parallel ranks sum the totals (the largest |d| by max): the gap of the union, a rank with no token
    included, whatever the split."""
    g = torch.Generator().manual_seed(0)
    old, engine = -torch.rand(50, generator=g) * 3, -torch.rand(50, generator=g) * 3
    for cuts in ([0, 50], [0, 5, 50], [0, 0, 37, 50], [0, 10, 20, 30, 50]):
        parts = [ca.logprob_gap_totals(old[a:b], engine[a:b]) for a, b in zip(cuts, cuts[1:])]
        combined = torch.cat([sum(p[:3] for p in parts), torch.stack([p[3] for p in parts]).max().reshape(1)])
        whole = ca.logprob_gap(old, engine)
        assert ca.logprob_gap_of_totals(combined) == pytest.approx(whole, rel=1e-12)
    assert ca.logprob_gap_totals(torch.zeros(0), torch.zeros(0)).tolist() == [0.0, 0.0, 0.0, 0.0]

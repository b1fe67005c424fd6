"""`_stems`: which prompts of a generation chunk share a prefill stem, by hand-counted positions."""

from empo2.rollout.engines.hf import _PASS_COST, _stems


def seq(*parts):
    return tuple(t for first, n in parts for t in range(first, first + n))


def test_one_long_common_prefix_is_one_stem():
    # 3 x (60 shared + 10 own): 210 positions whole, 32 + 60 + 30 = 122 with the stem
    seqs = [seq((0, 60), (1000 + 100 * i, 10)) for i in range(3)]
    assert _stems(seqs) == [60, 60, 60]


def test_a_short_common_prefix_is_not_worth_a_pass():
    # 2 x (5 shared + 40 own): a stem saves 5 positions for a pass of _PASS_COST
    seqs = [seq((0, 5), (1000 + 100 * i, 40)) for i in range(2)]
    assert _PASS_COST > 5 and _stems(seqs) == [0, 0]


def test_each_cluster_gets_its_own_stem_and_a_loner_none():
    # two tasks (50 shared each, 3 global) and one unrelated prompt; the input order does not matter
    a = [seq((0, 3), (100, 50), (1000 + 100 * i, 8)) for i in range(3)]
    b = [seq((0, 3), (500, 50), (2000 + 100 * i, 8)) for i in range(2)]
    loner = seq((9000, 30))
    seqs = [b[0], a[0], loner, a[1], b[1], a[2]]
    assert _stems(seqs) == [53, 53, 0, 53, 53, 53]


def test_a_stem_leaves_every_member_a_token_of_its_own():
    # one sequence is a prefix of the others: the stem stops one token short of it
    short = seq((0, 80))
    seqs = [short, short + seq((500, 20)), short + seq((700, 20))]
    assert _stems(seqs) == [79, 79, 79]
    assert _stems([]) == [] and _stems([short]) == [0]


def test_nested_prefixes_take_the_cheaper_cut():
    # 4 prompts share 40 tokens; 2 of them share 100 more. Stems of 140 for that pair and of 40 for the other:
    # (32 + 140 + 2*10) + (32 + 40 + 2*60) = 384; the pair's stem, the others whole: 192 + 200 = 392; one
    # stem of 40 for all: 32 + 40 + 2*110 + 2*60 = 412; all whole: 2*150 + 2*100 = 500
    pair = [seq((0, 40), (300, 100), (1000 + 100 * i, 10)) for i in range(2)]
    rest = [seq((0, 40), (5000 + 100 * i, 60)) for i in range(2)]
    assert _stems(pair + rest) == [140, 140, 40, 40]

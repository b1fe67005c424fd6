"""The mini-batch plan of one PPO epoch: every sample exactly once, ranks in step, loss normalisers."""

import pytest
import torch

from empo2.lit.data import plan_epoch, step_counts


def _check(plan, lengths, n_mini, micro_per_mini=None):
    assert len(plan) == n_mini
    counted = [i for mini in plan for mb in mini if mb.weight for i in mb.indices]
    assert sorted(counted) == list(range(len(lengths)))  # each sample counts exactly once per epoch
    for mini in plan:
        assert [mb.last for mb in mini] == [False] * (len(mini) - 1) + [True]
        real = [i for mb in mini if mb.weight for i in mb.indices]
        assert all(mb.num_seqs == len(real) and mb.num_tokens == sum(lengths[i] for i in real) for mb in mini)
        if micro_per_mini is not None:
            assert len(mini) == micro_per_mini


def test_seventy_samples_in_mini_batches_of_sixteen_on_one_rank():
    lengths = [1 + i % 7 for i in range(70)]
    n_mini, micro_per_mini = step_counts(70, 1, 16, 4)
    assert (n_mini, micro_per_mini) == (5, None)
    plan = plan_epoch(lengths, n_mini, 4, micro_per_mini, torch.Generator().manual_seed(0))
    _check(plan, lengths, 5)
    assert [mini[0].num_seqs for mini in plan] == [14] * 5  # 80 draws would have repeated 10 samples


@pytest.mark.parametrize("counts", [(70, 30), (70, 3), (16, 16), (9, 1)])
def test_two_ranks_run_the_same_steps_and_micro_batches_without_repeating_a_sample(counts):
    n_mini, micro_per_mini = step_counts(max(counts), 2, 16, 4)
    plans = []
    for rank, n in enumerate(counts):
        lengths = [1 + (i * 3 + rank) % 5 for i in range(n)]
        plan = plan_epoch(lengths, n_mini, 4, micro_per_mini, torch.Generator().manual_seed(rank))
        _check(plan, lengths, n_mini, micro_per_mini)
        plans.append(plan)
    # identical structure: the k-th backward of one rank meets the k-th backward of the other
    assert [[mb.last for mb in mini] for mini in plans[0]] == [[mb.last for mb in mini] for mini in plans[1]]


def test_a_plan_is_a_function_of_the_generator():
    lengths = list(range(1, 20))
    a = plan_epoch(lengths, 3, 2, None, torch.Generator().manual_seed(5))
    b = plan_epoch(lengths, 3, 2, None, torch.Generator().manual_seed(5))
    assert a == b


def _padded_positions(plan, sizes):
    return sum(len(mb.indices) * max(sizes[i] for i in mb.indices) - sum(sizes[i] for i in mb.indices)
               for mini in plan for mb in mini)


def test_length_grouping_changes_only_the_micro_batch_cut_and_shrinks_the_padding():
    g = torch.Generator().manual_seed(0)
    n = 64
    lengths = [1 + int(x) for x in torch.randint(0, 8, (n,), generator=g)]  # response tokens
    sizes = [100 + int(x) for x in torch.randint(0, 280, (n,), generator=g)]  # prompt + response
    plain = plan_epoch(lengths, 4, 4, None, torch.Generator().manual_seed(1))
    grouped = plan_epoch(lengths, 4, 4, None, torch.Generator().manual_seed(1), sizes)
    _check(grouped, lengths, 4)
    for a, b in zip(plain, grouped):  # each mini-batch holds the same samples and normalisers
        assert sorted(i for mb in a for i in mb.indices) == sorted(i for mb in b for i in mb.indices)
        assert (a[0].num_tokens, a[0].num_seqs) == (b[0].num_tokens, b[0].num_seqs)
        cut = [sizes[i] for mb in b for i in mb.indices]
        assert cut == sorted(cut)  # micro-batches cut in order of size
    assert _padded_positions(grouped, sizes) < 0.5 * _padded_positions(plain, sizes)


def test_length_grouping_keeps_ranks_in_step():
    n_mini, micro_per_mini = step_counts(70, 2, 16, 4)
    structures = []
    for rank, n in enumerate((70, 30)):
        lengths = [1 + i % 5 for i in range(n)]
        sizes = [50 + (i * 37) % 200 for i in range(n)]
        plan = plan_epoch(lengths, n_mini, 4, micro_per_mini, torch.Generator().manual_seed(rank), sizes)
        _check(plan, lengths, n_mini, micro_per_mini)
        structures.append([[mb.last for mb in mini] for mini in plan])
    assert structures[0] == structures[1]

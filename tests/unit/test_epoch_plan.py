"""The mini-batch plan of one PPO epoch: every sample exactly once, ranks in step, loss normalisers."""

import pytest
import torch

from empo2.lit.data import (
    RolloutDataModule,
    cut_micro_batches,
    mini_batch_counts,
    plan_epoch,
    plan_iteration,
    step_counts,
    with_normalisers,
)
from empo2.rollout.types import StepSample


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
    prompts = [s - r for s, r in zip(sizes, lengths)]
    plain = plan_epoch(lengths, 4, 4, None, torch.Generator().manual_seed(1))
    grouped = plan_epoch(lengths, 4, 4, None, torch.Generator().manual_seed(1), prompts)
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
        prompts = [50 + (i * 37) % 200 for i in range(n)]
        plan = plan_epoch(lengths, n_mini, 4, micro_per_mini, torch.Generator().manual_seed(rank), prompts)
        _check(plan, lengths, n_mini, micro_per_mini)
        structures.append([[mb.last for mb in mini] for mini in plan])
    assert structures[0] == structures[1]


def test_a_token_budget_cuts_where_rows_times_the_longest_prompt_plus_response_would_pass_it():
    prompts, responses = [10, 20, 30, 40, 90], [2, 5, 1, 3, 20]
    # rows x (longest prompt + longest response): [0,1] 2 x 25 = 50; adding 2 -> 3 x 35 = 105 > 100
    assert cut_micro_batches([0, 1, 2, 3, 4], 4, responses, prompts, 100) == [[0, 1], [2, 3], [4]]
    # [2,3] is 2 x 45 = 90; sample 4 alone is 110, over the budget: it still trains, alone
    assert cut_micro_batches([0, 1, 2, 3, 4], 4, responses, prompts, 1000) == [[0, 1, 2, 3], [4]]
    assert cut_micro_batches([0, 1, 2, 3, 4], 2, responses, prompts, None) == [[0, 1], [2, 3], [4]]
    assert cut_micro_batches([4, 0], 4, responses, prompts, 50) == [[4], [0]]  # nothing is merged into a giant


def test_a_token_budget_keeps_each_mini_batch_and_bounds_every_micro_batch():
    g = torch.Generator().manual_seed(0)
    n, budget = 64, 1200
    lengths = [1 + int(x) for x in torch.randint(0, 8, (n,), generator=g)]
    prompts = [100 + int(x) for x in torch.randint(0, 280, (n,), generator=g)]
    grouped = plan_epoch(lengths, 4, 8, None, torch.Generator().manual_seed(1), prompts)
    capped = plan_epoch(lengths, 4, 8, None, torch.Generator().manual_seed(1), prompts, budget)
    _check(capped, lengths, 4)
    for a, b in zip(grouped, capped):  # the same samples and normalisers per mini-batch: the same gradient
        assert [i for mb in a for i in mb.indices] == [i for mb in b for i in mb.indices]
        assert (a[0].num_tokens, a[0].num_seqs) == (b[0].num_tokens, b[0].num_seqs)
        for mb in b:
            padded = len(mb.indices) * (max(prompts[i] for i in mb.indices) + max(lengths[i] for i in mb.indices))
            assert len(mb.indices) <= 8 and (padded <= budget or len(mb.indices) == 1)
    assert sum(map(len, capped)) > sum(map(len, grouped))  # the budget did cut: more, smaller micro-batches


def test_a_token_budget_without_prompt_lengths_is_refused():
    with pytest.raises(ValueError, match="token budget needs the prompt lengths"):
        plan_epoch([1, 2], 1, 2, None, torch.Generator().manual_seed(0), token_budget=10)


def test_ranks_agree_on_the_micro_batch_count_their_token_budgets_need():
    """Under a budget the cut depends on each rank's sample sizes: every rank runs the largest count any rank
    needs (zero-weight padding elsewhere), so their backward passes stay in step."""
    def samples(n, rank):
        prompts = [[1] * (20 + (i * 53 + rank * 31) % 200) for i in range(n)]
        return [StepSample(behaviour_ids=p, train_ids=p, response_ids=[2] * (1 + i % 6), memory=False,
                           offpolicy=False, group_id=0, traj_id=i, step=0) for i, p in enumerate(prompts)]

    per_rank = [samples(40, 0), samples(25, 1)]
    dm = RolloutDataModule(ppo_epochs=2, mini_batch_size=16, micro_batch_size=8, seed=0, token_budget=600)
    n_mini, _ = step_counts(40, 2, 16, 8)
    needed = [dm.micro_batches_needed(s, 3, n_mini, rank) for rank, s in enumerate(per_rank)]
    assert needed[0] != needed[1]  # left alone, the ranks would run different numbers of backward passes
    structures = []
    for rank, s in enumerate(per_rank):
        plan = plan_iteration(s, 3, n_mini, 2, 8, 600, max(needed), 0, rank)
        structures.append([[mb.last for mb in mini] for mini in plan])
        assert all(len(mini) == max(needed) for mini in plan)
    assert structures[0] == structures[1]


def test_the_global_normalisers_are_the_union_of_the_ranks_kth_mini_batches():
    """Rank 0 holds 5 long responses, rank 1 two short ones (11x fewer tokens), so rank 1's first mini-batch is
    empty: the sum of the ranks' counts is each global mini-batch's valid tokens and responses, and every
    micro-batch of every rank, padding included, normalises by them; indices, weights and steps are unchanged."""
    lengths = [[9, 11, 8, 10, 6], [2, 2]]
    n_mini, micro_per_mini = step_counts(5, 2, 2, 1)
    plans = [plan_epoch(ls, n_mini, 1, micro_per_mini, torch.Generator().manual_seed(r))
             for r, ls in enumerate(lengths)]
    assert mini_batch_counts(plans[1])[0] == (0, 0)  # rank 1 has no sample in the first mini-batch
    normalisers = [tuple(map(sum, zip(*ks))) for ks in zip(*map(mini_batch_counts, plans))]
    for plan in plans:
        globalised = with_normalisers(plan, normalisers)
        for k, (mini, old) in enumerate(zip(globalised, plan)):
            union = [(r, i) for r, p in enumerate(plans) for mb in p[k] if mb.weight for i in mb.indices]
            assert all((mb.num_tokens, mb.num_seqs) == (sum(lengths[r][i] for r, i in union), len(union))
                       for mb in mini)
            assert [(mb.indices, mb.weight, mb.last) for mb in mini] == [(mb.indices, mb.weight, mb.last) for mb in old]
    assert sum(t for t, _ in normalisers) == sum(map(sum, lengths)) and sum(s for _, s in normalisers) == 7
    with pytest.raises(ValueError, match="2 normalisers for a plan of 3 mini-batches"):
        with_normalisers(plans[0], normalisers[:2])


def test_one_rank_keeps_its_own_counts():
    samples = [StepSample(behaviour_ids=[1], train_ids=[1], response_ids=[2] * (1 + i), memory=False, offpolicy=False,
                          group_id=0, traj_id=i, step=0) for i in range(5)]
    dm = RolloutDataModule(ppo_epochs=1, mini_batch_size=2, micro_batch_size=1, seed=0)
    assert dm.set_rollouts(samples, [], 0) == 3
    plan = dm.buffer.plan
    assert [len(mini) for mini in plan] == [1, 2, 2]  # array_split of 5 into 3; no zero-weight padding on one rank
    for mini in plan:
        own = [i for mb in mini for i in mb.indices]
        assert all((mb.num_tokens, mb.num_seqs, mb.weight) == (sum(1 + i for i in own), len(own), 1.0) for mb in mini)
    assert [mb.closes_iteration for mini in plan for mb in mini] == [False] * 4 + [True]

"""The novelty counter behind r_int(s) = 1/n(s): counts must be a function of the batch, not of its order."""

from empo2.rollout.novelty import NoveltyCounter


def test_novelty_counts_of_one_step_do_not_depend_on_rollout_order():
    keys = ["a", "b", "a", "c", "a", "b"]
    c = NoveltyCounter()
    c.counts = {"a": 2}
    counts = c.visit_step(keys)
    assert counts == [5, 2, 5, 1, 5, 2]  # every visit of the step is counted before any is read
    perm = [3, 0, 5, 1, 4, 2]
    c2 = NoveltyCounter()
    c2.counts = {"a": 2}
    assert c2.visit_step([keys[i] for i in perm]) == [counts[i] for i in perm]
    assert c2.counts == c.counts

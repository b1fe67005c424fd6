"""`length_buckets`: which rows of a micro-batch share a right-padded pass, by hand-counted positions."""

from empo2.lit.packing import length_buckets


def test_near_lengths_share_a_pass_and_far_ones_do_not():
    # pass cost 20: {10, 11, 12} padded to 12 and {100, 101} to 101 run 20 + 36 + 20 + 202 = 278 positions;
    # one pass 20 + 5 * 101 = 525; a pass each 100 + 334 = 434
    assert length_buckets([100, 10, 12, 101, 11], 20) == [[1, 4, 2], [0, 3]]


def test_a_free_pass_never_pads_and_a_dear_one_is_taken_once():
    assert length_buckets([7, 9, 8], 0) == [[0], [2], [1]]
    assert length_buckets([7, 9, 8], 1000) == [[0, 2, 1]]


def test_rows_of_one_length_always_share_a_pass():
    assert length_buckets([50, 50, 50], 0.5) == [[0, 1, 2]]
    assert length_buckets([], 10) == []

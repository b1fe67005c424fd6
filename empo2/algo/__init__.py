"""The algorithm's math, at the bottom of the layers: `core_algos` (group advantages, the count bonus, the low-prob
mask, the clipped policy loss and its aggregation: pure functions of tensors and plain scalars, each citing the
paper's mechanism) and `stats` (the intervals runs are compared with). Imports nothing of empo2."""

"""How the CPU update packs a micro-batch into forward passes (`EMPO2Module._response_logits` on a CPU): rows
right-padded without a mask, a shared system-and-task prefix run once, and rows grouped into passes of similar
length. The same numbers as one padded pass, to float32 rounding, in fewer positions."""

from __future__ import annotations

import torch

from empo2.models.prefix_cache import PrefixCaches, caches_through_checkpoints, cheapest_runs


def packed_response_logits(model, batch: dict[str, torch.Tensor], passes: list | None = None) -> torch.Tensor:
    """`EMPO2Module._response_logits` on a CPU: the logits of the last T+1 columns of the left-padded batch,
    (B, T+1, V), zeros past a row's own response.

    Rows run without an attention mask, right-padded: causal attention keeps every real position's
    numbers free of the padding after it, and the attention kernel skips the causal half (a 16-row
    micro-batch of the headline's 200-380-token prompts: forward and backward 16% faster than one masked,
    left-padded pass; SmolLM2, 8 rows: 12%). Rows that share their system and task text (`prefix_len`) run it
    once: a first pass over each distinct prefix keeps its keys and values, and the rest of every row attends
    to them (a headline micro-batch: 30% fewer positions, forward and backward 12-16% faster), with gradient
    checkpointing too (`caches_through_checkpoints`). The rest runs in passes of similar lengths
    (`length_buckets`: a pass has a fixed cost, `PASS_COST` positions, so rows tens of tokens apart share one).
    A row's numbers depend on what it is batched with only at float32 rounding. On a GPU one padded pass is
    cheaper.

    With `passes` (a list), each pass's logits leave the graph: the returned logits are built from leaves, and
    (outputs, leaves) pairs are appended for `EMPO2Module.backward_passes`: each pass's logits, and first, where
    prefixes are shared under gradient checkpointing, the prefixes' keys and values (`PrefixCaches.detach`).
    In one backward through several passes the autograd engine holds each parameter's gradient until the
    last pass using it is done, a second full set of gradients (docs/performance.md); pass by pass, each
    reaches `.grad` at once. Without checkpointing shared prefixes keep the graph whole."""
    T = batch["response_ids"].shape[1]
    mask = batch["attention_mask"].bool()  # (B, P+T): a row's real tokens are contiguous
    lengths, response = mask.sum(-1).tolist(), batch["response_mask"].sum(-1).tolist()
    rows = [batch["input_ids"][b][mask[b]] for b in range(len(lengths))]  # (n_b,) prompt + response each
    # the second pass must hold the last prompt token (its logits predict the first response token)
    share = "prefix_len" in batch
    cut = [c if 0 < c < n - t else 0 for c, n, t in
           zip(batch["prefix_len"].tolist() if share else [0] * len(rows), lengths, response)]
    prefix = [tuple(row[:c].tolist()) for row, c in zip(rows, cut)]  # () where a row is not cut
    caches = PrefixCaches(model.get_decoder(), prefix, rows[0].device)
    if not caches.ok:  # layers whose cache is not plain keys and values (sliding window, ...)
        cut = [0] * len(rows)
    # Pass by pass with shared prefixes too where the run trades time for memory (gradient checkpointing): the
    # prefixes' keys and values become leaves that every pass adds its gradient into, and the prefix passes run
    # their own backward last. Without checkpointing shared prefixes keep one graph (recorded runs' numbers hold
    # to the digit; the order in which gradients add up would change them at float32 rounding).
    staged = passes is not None and (not any(cut) or getattr(model, "is_gradient_checkpointing", False))
    if staged and any(cut):
        passes.append(caches.detach())  # popped last: its backward needs every pass's gradient first
    groups: dict[int, list[int]] = {}  # cut -> rows, each group cut into passes by length
    for b, c in enumerate(cut):
        groups.setdefault(c, []).append(b)
    parts, order = [], []
    for c, members in groups.items():
        for bucket in length_buckets([lengths[b] - c for b in members], PASS_COST):
            run = [members[i] for i in bucket]
            width = max(lengths[b] for b in run) - c
            ids = torch.zeros((len(run), width), dtype=torch.long)  # (m, width), right-padded
            for j, b in enumerate(run):
                ids[j, :lengths[b] - c] = rows[b][c:]
            # row b's logits predicting its response (and the token after it) sit at first[b] .. end[b] - 1
            first = {b: lengths[b] - c - response[b] - 1 for b in run}
            keep = sorted({p for b in run for p in range(first[b], first[b] + response[b] + 1)})
            # the prefix lent, not grown: a checkpointed layer's recompute sees the keys and values it first saw
            past = caches.rows([prefix[b] for b in run], grow=False) if c else None
            with caches_through_checkpoints(model):
                out = model(input_ids=ids, past_key_values=past, use_cache=False,
                            logits_to_keep=torch.tensor(keep)).logits  # (m, len(keep), V)
            if staged:  # the loss's graph ends at a leaf; `EMPO2Module.backward_passes` carries its gradient on
                leaf = out.detach().requires_grad_()
                passes.append(((out,), (leaf,)))
                out = leaf
            at = {p: k for k, p in enumerate(keep)}
            for j, b in enumerate(run):
                own = out[j, [at[p] for p in range(first[b], first[b] + response[b] + 1)]]  # (t_b+1, V)
                parts.append(torch.nn.functional.pad(own, (0, 0, 0, T - response[b])))  # (T+1, V)
            order += run
    logits = torch.stack(parts)  # (B, T+1, V) in pass order
    return logits[torch.tensor(order).argsort()]  # back to batch order


# What one more decoder pass costs the CPU update's forward and backward beyond its positions, in positions: a
# pass streams every weight and writes every weight's gradient once, and runs each layer's kernels once however
# few its rows. `benchmarks/pass_cost.py` measures it per model (docs/performance.md); the two presets measured
# there sit either side of this one constant, and near the best grouping the positions run change slowly with it.
PASS_COST = 75


def length_buckets(lengths: list[int], pass_cost: float) -> list[list[int]]:
    """Rows (indices into `lengths`) grouped into right-padded passes: a pass runs as many positions per row as
    its longest row, plus `pass_cost`; the grouping of the length-sorted rows into consecutive runs that runs the
    fewest (`cheapest_runs`). The LM head's extra positions (a pass keeps the union of
    its rows' response positions) are left out: one costs about a fifth of a decoder position on these models."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[i:j] for i, j in cheapest_runs(len(order), lambda i, j: pass_cost + (j - i) * lengths[order[j - 1]])]

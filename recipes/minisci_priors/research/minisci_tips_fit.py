"""How well the cached `minisci_tips` prior fits its own training data, per kind of sequence and target.

For 48 random training sequences of each kind (whole episodes: prior-driven tip-free, gold under tips that
locate what is needed, a search under a tip that names a failed look-alike, prior-driven under another family's
tips, misled by a wrong tip): mean loss per target token of the actions and of the hindsight tip, and how many
actions / tips greedy decoding (teacher-forced) reproduces exactly. An ability whose training loss is still
high was not learned, whatever the calibration shows; actions under tips fitting as well as tip-free ones
while they differ means the tips in the prompt are read.

    python -m recipes.minisci_priors.research.minisci_tips_fit
"""

from __future__ import annotations

import random
import statistics

import torch

from empo2.models.io import load_local
from recipes.minisci_priors.prior import TARGET, _batch, ready_path
from recipes.minisci_priors.prior_tips import KINDS, TipPriorSettings, dev_episodes, prompt_builder, training_sequences


def spans(kinds: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of TARGET positions: one per action, the last one the tip."""
    out, start = [], None
    for i, k in enumerate(kinds + [None]):
        if k == TARGET and start is None:
            start = i
        elif k != TARGET and start is not None:
            out.append((start, i))
            start = None
    return out


def main(per_kind: int = 48, batch: int = 8) -> None:
    torch.set_num_threads(2)
    settings = TipPriorSettings()
    path = ready_path("minisci_tips", settings)
    if path is None:
        raise SystemExit("no minisci_tips with the current settings: build it first (any run with model=minisci_tips)")
    model, tok = load_local(path, torch.float32)  # the tokenizer it was trained with
    model.eval()
    sequences = training_sequences(prompt_builder(tok), dev_episodes(settings), settings)
    rng = random.Random(0)
    print("| sequences | action loss per token | actions exact | tip loss per token | tips exact |")
    print("|---|---|---|---|---|")
    for kind in KINDS:
        pool = rng.sample([(ids, kinds) for k, ids, kinds in sequences if k == kind], per_kind)
        acts, tips = [], []  # (loss per token, exact) per span
        for i in range(0, len(pool), batch):
            chunk = pool[i:i + batch]
            ids, mask, _ = _batch(chunk, tok.pad_token_id)
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=mask).logits  # (B, T, V)
            nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
            for r, (_, kinds) in enumerate(chunk):
                found = spans(kinds)
                for j, (a, b) in enumerate(found):  # token t is predicted at position t - 1
                    row = (nll[r, a - 1:b - 1].mean().item(),
                           bool((logits[r, a - 1:b - 1].argmax(-1) == ids[r, a:b]).all()))
                    (tips if j == len(found) - 1 else acts).append(row)

        def cell(rows):
            return (f"{statistics.fmean(x for x, _ in rows):.3f}", f"{sum(e for _, e in rows)}/{len(rows)}") \
                if rows else ("-", "-")

        print(f"| {kind} | {' | '.join(cell(acts))} | {' | '.join(cell(tips))} |")


if __name__ == "__main__":
    from empo2.utils import quiet_libraries

    quiet_libraries()  # weight-loading bars and INFO lines off, as in the CLI
    main()

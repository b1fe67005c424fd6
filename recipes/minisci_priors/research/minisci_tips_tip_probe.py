"""Is the `minisci_tips` prior's tip writing limited by training time? A probe, not a build.

Continues training the cached prior on its own training sequences with only the hindsight tip as the target
(the actions become context, still predicted with weight `lm_weight`), for `--steps` more steps, and writes the
result as a project checkpoint that the calibration loads with

    python -m recipes.minisci_priors.research.minisci_calibration --model minisci_tips --memory \\
        --override model.name=hf model.path=OUT model.dtype=float32 ...

If the share of true tips and the memory-only curve rise well above the prior's, tip writing was short of
training; if not, the tips it writes at run time fail for another reason (episodes unlike the scripted ones).

    python -m recipes.minisci_priors.research.minisci_tips_tip_probe --steps 300 --out /tmp/minisci-tips-tip-probe
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from empo2.config.presets import MINISCI_TIPS_LAYOUT
from empo2.models.io import save_cached_checkpoint
from recipes.minisci_priors.prior import CONTEXT, TARGET, behaviour_clone
from recipes.minisci_priors.prior_tips import TipPriorSettings, cached_prior


def tip_only(kinds: list[int]) -> list[int]:
    """The same sequence with every TARGET before the last CONTEXT position (the actions) made CONTEXT."""
    start = max(i for i, k in enumerate(kinds) if k == CONTEXT) + 1  # the tip follows the request's last token
    return [CONTEXT if k == TARGET and i < start else k for i, k in enumerate(kinds)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(2)
    settings = TipPriorSettings()
    try:
        path, model, tok, sequences = cached_prior(settings)
    except FileNotFoundError as e:  # not built yet: say so in one line
        raise SystemExit(str(e)) from None
    examples = [(ids, tip_only(kinds)) for _, ids, kinds in sequences]
    probe = dataclasses.replace(settings, lr=args.lr, epochs=args.steps * settings.batch_size / len(examples))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        stats = behaviour_clone(model, examples, probe, tok.pad_token_id, name="tip probe", by_length=True,
                                lm_weight=settings.lm_weight)
    save_cached_checkpoint(model, tok, {"probe_of": str(path), "settings": dataclasses.asdict(probe),
                                        "stats": stats, "prompt_layout": MINISCI_TIPS_LAYOUT}, Path(args.out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    from empo2.utils import quiet_libraries

    quiet_libraries()  # weight-loading bars and INFO lines off, as in the CLI
    main()

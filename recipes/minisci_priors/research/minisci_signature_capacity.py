"""Can a policy of a given size learn to read a tip's signature? Decision states only, each size from scratch.

No tip prior built so far reads the signature its tips open with (reports/minisci_priors/README.md, "Tips that
differ only in their signature"), and rounds from a built prior did not teach it: they start from a policy that has
already learned to obey a tip block. This asks the question of the architecture alone. At the decision states of
find-living-thing dev instances (`prior_tips.decision_states`), the examples of `decision_examples(resigned=True)`:
the gold path's action under the instance's own signed tips, and the labeller's tip-free distribution under the same
tips re-signed with another house's signature, and tip-free, so that only the signature tells the first two apart. A
fresh model of each size (`models.build_tiny_model`, the labeller's tokenizer) is trained on them alone, and
`decision_shift` gives P(gold action) tip-free / own gold tip / re-signed on ~300 of the states it trained at and on
held-out house draws. A size that reads the signature opens a gap between the two; one that cannot fits about the
mean of the two labels under both.

    python -m recipes.minisci_priors.research.minisci_signature_capacity --labeller outputs/priors/reader-v7 \\
        --sizes 4x128 4x256 \\
        --out reports/minisci_priors/signature_capacity.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import random
from pathlib import Path

import torch

from empo2.utils import quiet_libraries  # noqa: E402

quiet_libraries()

from empo2.config import ConfigError, load_config  # noqa: E402
from empo2.models import load_policy  # noqa: E402
from empo2.models.io import build_tiny_model  # noqa: E402
from recipes.minisci_priors.prior import behaviour_clone, dev_instances  # noqa: E402
from recipes.minisci_priors.prior_rounds import decision_examples, decision_shift, decision_states  # noqa: E402
from recipes.minisci_priors.prior_tips import TipPriorSettings  # noqa: E402

FAMILY = "find-living-thing"


def size(text: str) -> tuple[int, int]:
    """`LAYERSxWIDTH`, e.g. 4x128."""
    layers, _, width = text.partition("x")
    try:
        return int(layers), int(width)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give LAYERSxWIDTH, e.g. 4x128") from None


def labeller_and_states(path: str, houses: int, seed: int) -> tuple:
    """The signed prior at `path` (eval mode) and its tokenizer, the decision states of `houses` draws per dev
    variation of the family, and those of one other draw each (held out)."""
    cfg = load_config(["model=minisci_tips_reader", "env=minisci", "model.name=hf", f"model.path={path}",
                       "model.dtype=float32"])
    try:
        labeller, tok = load_policy(cfg.model)
    except ConfigError as e:  # a wrong path: one line naming it
        raise SystemExit(f"--labeller: {e}") from None
    labeller.eval()
    states = decision_states([i for i in dev_instances(random.Random(seed + 7), houses) if i[0] == FAMILY], seed=seed)
    held = decision_states([i for i in dev_instances(random.Random(seed + 8), 1) if i[0] == FAMILY], seed=seed + 1)
    return labeller, tok, states, held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--labeller", required=True, help="a signed prior: its tokenizer, and its tip-free labels")
    ap.add_argument("--sizes", nargs="+", type=size, default=[(4, 128), (4, 256)], metavar="LAYERSxWIDTH")
    ap.add_argument("--houses", type=int, default=16, help="house draws per dev variation whose states it trains at")
    ap.add_argument("--epochs", type=float, default=6.0)
    ap.add_argument("--lr", type=float, default=3e-3, help="the stage-1 build's, from scratch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "signature_capacity.json"))
    args = ap.parse_args()
    if args.houses < 1 or args.epochs <= 0:
        ap.error("--houses and --epochs must be positive")
    torch.set_num_threads(args.threads)
    labeller, tok, states, held = labeller_and_states(args.labeller, args.houses, args.seed)
    trained = states[::max(1, len(states) // 300)]
    examples = decision_examples(labeller, tok, states, 2, seed=args.seed, resigned=True)
    print(f"{len(states)} decision states ({len(examples)} examples), {len(held)} held out", flush=True)
    settings = dataclasses.replace(TipPriorSettings(), epochs=args.epochs, lr=args.lr, seed=args.seed)

    def shift(model) -> dict:
        return {"trained": decision_shift(model, tok, trained), "held_out": decision_shift(model, tok, held)}

    results = {"labeller": shift(labeller)}
    print("| model | states | P(gold action): tip-free / own gold tip / own re-signed |\n|---|---|---|")

    def row(label: str, res: dict) -> None:
        for where in ("trained", "held_out"):
            cells = " / ".join(f"{res[where][k]['gold']:.2f}" for k in ("tip_free", "own", "resigned"))
            print(f"| {label} | {where} ({res[where]['states']}) | {cells} |", flush=True)

    row("labeller", results["labeller"])
    for layers, width in args.sizes:
        model = build_tiny_model(tok, args.seed, hidden_size=width, num_layers=layers)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(args.seed)
            fit = behaviour_clone(model, examples, settings, tok.pad_token_id, name=f"{layers}x{width}",
                                  by_length=True, lm_weight=settings.lm_weight)
        model.eval()
        label = f"{layers}x{width}"
        results[label] = shift(model) | {"fit": fit, "parameters": sum(p.numel() for p in model.parameters())}
        row(label, results[label])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": platform.platform(), "args": vars(args), "states": len(states),
                               "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

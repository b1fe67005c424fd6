"""Is the signature match in a prior at all, and can the architecture learn it when told the answer?

No tip prior reads the signature its tips open with, and neither rounds from a built prior nor training a fresh
model on re-signed decision-state pairs taught it (reports/minisci_priors/README.md, "Tips that differ only in
their signature"; `minisci_signature_capacity.py`). Those runs teach the match only through actions, whose labels
differ little between the two prompts. This asks for the match itself, at the decision states of find-living-thing
dev instances, with `prior_tips.signature_match_examples` (the gold path's signed tip and the same tip re-signed
with another house's signature; only the signature differs):

1. the labeller's own hidden state at the prompt's last token, where it chooses its action: can a linear probe,
   per layer, tell the own tip from the re-signed one on held-out house draws? A reader of the signature must
   carry that bit there;
2. told directly: the labeller itself and fresh models of the given sizes, each with a linear head trained on the
   match (binary cross-entropy at the last token of every signature field and at the prompt's last token,
   the model trained with it), donors redrawn every pass; held-out accuracy against the majority answer as it
   trains. A model that learns neither has no way to read the signature at these budgets, whatever the data;
3. whether the match, once told, moves the labeller's actions with no action trained (`decision_shift` on the
   held-out states before and after). `--save` keeps each told model and its head for later probes.

    python -m recipes.minisci_priors.research.minisci_signature_probe --labeller outputs/priors/reader-v7 \\
        --sizes 4x128 --steps 4000 \\
        --out reports/minisci_priors/signature_probe.json
    python -m recipes.minisci_priors.research.minisci_signature_probe --labeller outputs/priors/reader-v7 \\
        --sizes --steps 12000 \\
        --every 1000 --out reports/minisci_priors/signature_probe_long.json   # the turn comes after ~7,000 steps
    python -m recipes.minisci_priors.research.minisci_signature_probe --labeller outputs/priors/reader-v7 \\
        --sizes --steps 10000 \\
        --every 1000 --save outputs/priors/told-v7 --out reports/minisci_priors/signature_probe_told.json
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from empo2.utils import quiet_libraries  # noqa: E402

quiet_libraries()

from empo2.config.presets import MINISCI_TIPS_LAYOUT  # noqa: E402
from empo2.models.io import build_tiny_model, save_cached_checkpoint  # noqa: E402
from recipes.minisci_priors.prior_rounds import (  # noqa: E402
    decision_shift,
    signature_match_accuracy,
    signature_match_batches,
    signature_match_examples,
    signature_match_loss,
)
from recipes.minisci_priors.research.minisci_signature_capacity import labeller_and_states, size  # noqa: E402

BATCH = 8


def hidden_states(model, batch: list[tuple]) -> tuple[torch.Tensor, ...]:
    """Every layer's hidden states (embeddings first) of a batch of examples: layers + 1 of (B, T, width)."""
    width = max(len(ids) for ids, _, _ in batch)
    ids = torch.tensor([ids + [0] * (width - len(ids)) for ids, _, _ in batch])  # (B, T); right padding, causal
    return model.model(input_ids=ids, output_hidden_states=True).hidden_states


def logistic(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Weights then bias of an L2-regularised logistic regression of y (n,) on x (n, width), by LBFGS."""
    w = torch.zeros(x.shape[1] + 1, requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=300)

    def closure():
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(x @ w[:-1] + w[-1], y) + 1e-3 * w[:-1].square().sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach()


def linear_probe(model, train: list[tuple], held: list[tuple]) -> list[dict]:
    """Per layer (0: the embeddings), a logistic regression (L2, LBFGS) of the own/re-signed bit on the hidden
    state at the prompt's last token: accuracy where it was fitted and on held-out states."""
    model.eval()
    y_train = torch.tensor([labels[-1] for _, _, labels in train])
    y_held = torch.tensor([labels[-1] for _, _, labels in held])

    def answers(data: list[tuple]) -> torch.Tensor:  # (examples, layers + 1, width) at the prompt's last token
        out = []
        with torch.no_grad():
            for k in range(0, len(data), 16):
                batch = data[k:k + 16]
                layers = torch.stack(hidden_states(model, batch), 1)  # (B, layers + 1, T, width)
                out.append(torch.stack([layers[n, :, len(ids) - 1] for n, (ids, _, _) in enumerate(batch)]))
        return torch.cat(out)

    every_train, every_held = answers(train), answers(held)
    rows = []
    for layer in range(every_train.shape[1]):
        x_train, x_held = every_train[:, layer], every_held[:, layer]
        mean, std = x_train.mean(0), x_train.std(0) + 1e-6
        x_train, x_held = (x_train - mean) / std, (x_held - mean) / std
        w = logistic(x_train, y_train)
        with torch.no_grad():
            rows.append({"layer": layer,
                         "train": ((x_train @ w[:-1] + w[-1] > 0).float() == y_train).float().mean().item(),
                         "held_out": ((x_held @ w[:-1] + w[-1] > 0).float() == y_held).float().mean().item()})
    return rows


def told(model, tok, states: list, held: list[tuple], steps: int, lr: float, seed: int, every: int,
         name: str) -> dict:
    """Train `model` with a linear head on the match, donors redrawn every pass; the held-out curve."""
    torch.manual_seed(seed)
    head = torch.nn.Linear(model.config.hidden_size, 1)
    opt = torch.optim.AdamW([*model.parameters(), *head.parameters()], lr=lr, weight_decay=0.0)
    model.train()
    curve, losses, t0 = [], [], time.perf_counter()
    for step, batch in zip(range(1, steps + 1), signature_match_batches(tok, states, seed, BATCH)):
        loss = signature_match_loss(model, head, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([*model.parameters(), *head.parameters()], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % every == 0 or step == steps:
            row = {"step": step, "loss": sum(losses[-every:]) / len(losses[-every:])}
            row |= signature_match_accuracy(model, head, held)
            curve.append(row)
            print(f"{name}: step {step}/{steps} loss {row['loss']:.3f} held-out accuracy answer {row['answer']:.2f} "
                  f"fields {row['fields']:.2f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    model.eval()
    return {"curve": curve, "seconds": time.perf_counter() - t0, "lr": lr, "head": head}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--labeller", required=True, help="a signed prior: probed as it is, then told the match")
    ap.add_argument("--sizes", nargs="*", type=size, default=[(4, 128)], metavar="LAYERSxWIDTH",
                    help="fresh models told the match too (the labeller's tokenizer)")
    ap.add_argument("--houses", type=int, default=8, help="house draws per dev variation whose states it trains at")
    ap.add_argument("--steps", type=int, default=3000, help=f"batches of {BATCH} prompts per model told the match")
    ap.add_argument("--lr", type=float, default=1e-3, help="the labeller's (a reader round's); fresh models 3x")
    ap.add_argument("--every", type=int, default=250, help="steps between held-out evaluations")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "signature_probe.json"))
    ap.add_argument("--save", help="a folder to save each told model in (its match head as match_head.pt)")
    args = ap.parse_args()
    if min(args.houses, args.steps, args.every) < 1 or args.lr <= 0:
        ap.error("--houses, --steps, --every and --lr must be positive")
    torch.set_num_threads(args.threads)
    labeller, tok, states, held_states = labeller_and_states(args.labeller, args.houses, args.seed)
    train, held = (signature_match_examples(tok, s, seed=args.seed) for s in (states, held_states))
    answers = [ls[-1] for _, _, ls in held]
    fields = [x for _, _, ls in held for x in ls[:-1]]
    majority = {"answer": max(sum(answers), len(answers) - sum(answers)) / len(answers),
                "fields": max(sum(fields), len(fields) - sum(fields)) / len(fields)}
    print(f"{len(states)} decision states, {len(held_states)} held out ({len(held)} prompts); majority answer "
          f"{majority['answer']:.2f}, fields {majority['fields']:.2f}", flush=True)

    probe = linear_probe(labeller, train, held)
    print("| layer | linear probe accuracy: fitted / held out |\n|---|---|")
    for row in probe:
        print(f"| {row['layer']} | {row['train']:.2f} / {row['held_out']:.2f} |", flush=True)

    models = {"labeller": copy.deepcopy(labeller)}
    results = {"labeller": told(models["labeller"], tok, states, held, args.steps, args.lr, args.seed, args.every,
                                "labeller")}
    for layers, width in args.sizes:
        name = f"{layers}x{width}"
        models[name] = build_tiny_model(tok, args.seed, hidden_size=width, num_layers=layers)
        results[name] = told(models[name], tok, states, held, args.steps, 3 * args.lr, args.seed, args.every, name)
        results[name]["parameters"] = sum(p.numel() for p in models[name].parameters())
    # Whether the match, once in the labeller, moves its actions with no action trained: P(gold action) tip-free /
    # own tip / re-signed on the held-out states, before and after (its LM head shares the embeddings it was told on).
    results["labeller"]["decision_shift"] = {"before": decision_shift(labeller, tok, held_states),
                                             "after": decision_shift(models["labeller"], tok, held_states)}
    for name, model in models.items():
        head = results[name].pop("head")
        if args.save:  # the told model and its match head, for what a later probe asks of them
            folder = Path(args.save) / name  # a project checkpoint: a round (--start) or a calibration loads it
            save_cached_checkpoint(model, tok, {"probe_of": args.labeller if name == "labeller" else None,
                                                "told_the_match": results[name]["curve"][-1],
                                                "prompt_layout": MINISCI_TIPS_LAYOUT, "tip_signature": True}, folder)
            torch.save(head.state_dict(), folder / "match_head.pt")
    shift = results["labeller"]["decision_shift"]
    print("| labeller, P(gold action) held out | tip-free / own gold tip / re-signed |\n|---|---|")
    for when in ("before", "after"):
        cells = " / ".join(f"{shift[when][k]['gold']:.2f}" for k in ("tip_free", "own", "resigned"))
        print(f"| {when} | {cells} |")
    print("| model told the match | steps | held-out accuracy: answer / fields (majority "
          f"{majority['answer']:.2f} / {majority['fields']:.2f}) |\n|---|---|---|")
    for name, res in results.items():
        last = res["curve"][-1]
        print(f"| {name} | {last['step']} | {last['answer']:.2f} / {last['fields']:.2f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": platform.platform(), "args": vars(args), "states": len(states),
                               "held_out_states": len(held_states), "majority": majority, "linear_probe": probe,
                               "told": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

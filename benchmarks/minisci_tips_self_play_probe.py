"""Does the `minisci-tips` prior write truer tips, and act better on tips, once it learns from episodes like its
own? A probe, not a build.

Stage-1 tips are learned from scripted episodes, in which the look-alike the prior-driven agent takes is the one
its task and house predict, so a tip can be guessed without reading the episode. This probe plays the cached
prior on every dev variation (one house draw each) through the real collector, memory on, `--episodes` episodes
per instance one after another (`empo2.prior_tips.self_play_examples`), labels each of its own tip requests with
the hindsight tip of the episode it played (its actions replayed in the same house), and fine-tunes on those
mixed with as many of its stage-1 training sequences (`--replay`, so its acting is not forgotten): DAgger for
the tip writer, `--iterations` rounds, each playing with the model the last one left and training on every
self-played example so far. With `--learn actions` it learns to read instead: each round plays every dev
instance once with the gold path's tip in memory and labels every state its episodes reach while only moving with
the expert's action there (`empo2.prior_tips.reader_examples`: DAgger for the reader); `--learn both` does both
in each round. With `--foreign house` (`task`) each round also plays every dev instance under the tips of another
instance of its family (of another family; `category`: of its family, whose target its task's category does not
admit) and labels each state it reaches with the action it samples itself
from the tip-free prompt there (`reader_examples(foreign=...)`: tips that do not apply should change nothing;
with `--distill`, the tip-free prompt's whole next-token distribution along that action); with `--contrast` each
state labelled under a locating tip also gets its twin under another house's signed tips, labelled from the
tip-free prompt (`reader_examples(contrast=True)`: the signature is all that tells the two apart); with
`--decisions N` each round also trains at the decision states of N fresh house draws of every dev variation of
`--decision-families` (the state where the gold path and the trapped prior-driven path part): the gold action
under the instance's own signed tips, the tip-free distribution under another house's and tip-free
(`prior_tips.decision_examples`; `--learn none` trains on these alone; `--resign`: the instance's own tips
re-signed with another house's signature in place of that house's tips, so that only the signature tells the
prompts apart), and prints the decision-state shift on held-out house draws, and on about 300 of the states it
trains at, before and after (`prior_tips.decision_shift`); `--match-weight W` also asks for the signature match
itself at those states, as an auxiliary loss of weight W beside the actions (`prior_tips.signature_match_loss`,
a linear head on the last hidden layer; held-out accuracy before and after);
`--replay-kinds` chooses which kinds of stage-1 sequence are mixed in. Writes a project checkpoint that the
calibration loads with

    python benchmarks/minisci_calibration.py --model minisci_tips --memory \\
        --override model.name=hf model.path=OUT model.dtype=float32 ...

    python benchmarks/minisci_tips_self_play_probe.py --out /tmp/minisci-tips-self-play   (~27 min on 2 cores)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
from pathlib import Path

import torch

from empo2.envs.minisci import FAMILIES, OOD_FAMILIES
from empo2.model_io import save_cached_checkpoint
from empo2.model_presets import MINISCI_TIPS_LAYOUT
from empo2.prior import behaviour_clone, dev_instances
from empo2.prior_tips import (
    KINDS,
    TipPriorSettings,
    cached_prior,
    decision_examples,
    decision_shift,
    decision_states,
    reader_examples,
    self_play_examples,
    signature_match_accuracy,
    signature_match_batches,
    signature_match_examples,
    signature_match_loss,
    tips_signed,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=1)
    ap.add_argument("--learn", choices=("tips", "actions", "both", "none"), default="tips",
                    help="what its own episodes teach: the tips it writes, its actions under a locating tip, both, or "
                         "nothing (no self-play: --decisions or --foreign examples only)")
    ap.add_argument("--foreign", nargs="+", choices=("house", "category", "task"), default=[],
                    help="also learn to act as without tips under another house's or another task's tips, or "
                         "another house's whose thing the task's category does not admit (see reader_examples)")
    ap.add_argument("--distill", action="store_true",
                    help="under --foreign tips, learn the tip-free prompt's whole next-token distribution along the "
                         "sampled action (KL to the tip-free policy) rather than the sampled action alone")
    ap.add_argument("--contrast", action="store_true",
                    help="with --learn actions (or both) and signed tips: each state labelled under the instance's "
                         "own tips also gets its twin under another house's tips, labelled as under --foreign")
    ap.add_argument("--decisions", type=int, default=0, metavar="HOUSES",
                    help="house draws per dev variation whose decision states each round trains at (signed tips; "
                         "~1,600 states per family at 24)")
    ap.add_argument("--decision-families", nargs="+", default=None,
                    help="families of the decision states (default: every in-distribution family)")
    ap.add_argument("--foreign-per-state", type=int, default=2,
                    help="sets of another house's tips per decision state (each a SOFT example)")
    ap.add_argument("--resign", action="store_true",
                    help="at decision states, the instance's own tips re-signed with another house's signature in "
                         "place of that house's tips: the signature the only difference (a capacity test)")
    ap.add_argument("--match-weight", type=float, default=0.0,
                    help="with --decisions: also train a linear head on the last hidden layer to tell whether each "
                         "signature field, and the whole signature, is the instance's own "
                         "(prior_tips.signature_match_loss on re-signed pairs of the decision states, one batch of 8 "
                         "per step, this weight); the head starts from --start's match_head.pt when it has one "
                         "(benchmarks/minisci_signature_probe.py --save) and is saved beside the checkpoint")
    ap.add_argument("--replay-kinds", nargs="+", choices=KINDS, default=list(KINDS),
                    help="kinds of stage-1 sequence mixed in (MISLED teaches searching after a tip proved wrong, the "
                         "opposite of what --foreign teaches after another house's tip proved wrong)")
    ap.add_argument("--setting", nargs="+", default=[], metavar="KEY=VALUE",
                    help="TipPriorSettings fields (numbers; booleans as 0 or 1) of the stage-1 sequences mixed in (with"
                         " --start: a prior built with other settings is not needed), e.g. irrelevant_rate=1 "
                         "tip_signature=1; with --start, tip_signature defaults to the checkpoint's")
    ap.add_argument("--episodes", type=int, default=3, help="episodes per dev instance, one after another")
    ap.add_argument("--replay", type=float, default=1.0, help="stage-1 sequences mixed in per self-played one")
    ap.add_argument("--epochs", type=float, default=3.0, help="over the examples of each fine-tuning round")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", default=None, help="continue from this checkpoint (an earlier probe's --out) instead "
                                                  "of the cached prior; its self-play examples are not carried over")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.distill and not (args.foreign or args.contrast):
        ap.error("--distill labels the states under --foreign tips or --contrast twins; give one of them too")
    if args.decisions < 0 or args.foreign_per_state < 0:
        ap.error("--decisions and --foreign-per-state count house draws and tip sets: give 0 or more")
    in_distribution = [f for f in FAMILIES if f not in OOD_FAMILIES]
    unknown = sorted(set(args.decision_families or []) - set(in_distribution))
    if unknown:
        ap.error(f"--decision-families {' '.join(unknown)}: not an in-distribution family (one of "
                 f"{', '.join(in_distribution)})")
    if args.match_weight < 0 or (args.match_weight and not args.decisions):
        ap.error("--match-weight asks for the signature at the --decisions states: give --decisions and a weight >= 0")
    if args.resign and not args.decisions:
        ap.error("--resign re-signs the tips of --decisions states; give --decisions too")
    if args.learn == "none" and not (args.decisions or args.foreign):
        ap.error("--learn none trains on --decisions or --foreign examples only; give one of them")
    if args.contrast and args.learn == "tips":
        ap.error("--contrast pairs the states of --learn actions (or both); give one of them")
    torch.set_num_threads(2)
    fields = {f.name: f.type for f in dataclasses.fields(TipPriorSettings)}
    changes = {}
    for item in args.setting:
        key, _, value = item.partition("=")
        if key not in fields or fields[key] not in ("float", "int", "bool"):
            raise SystemExit(f"--setting {item}: {key!r} is not a numeric or boolean TipPriorSettings field")
        try:
            if fields[key] == "bool":
                changes[key] = {"1": True, "true": True, "0": False, "false": False}[value.lower()]
            else:
                changes[key] = float(value) if fields[key] == "float" else int(value)
        except (KeyError, ValueError):
            raise SystemExit(f"--setting {item}: {key} takes a {'0 or 1' if fields[key] == 'bool' else 'number'} "
                             f"({fields[key]})") from None
    if args.start and "tip_signature" not in changes:  # its tips are labelled as the checkpoint learned them
        changes["tip_signature"] = tips_signed(args.start)
    settings = dataclasses.replace(TipPriorSettings(), **changes)
    signature = settings.tip_signature
    if (args.contrast or args.decisions) and not signature:
        raise SystemExit("--contrast and --decisions need signed tips (tip_signature): without them a prompt under "
                         "another house's tips reads like one under its own")
    try:
        path, model, tok, sequences = cached_prior(settings, args.start)
    except FileNotFoundError as e:  # not built yet: say so in one line
        raise SystemExit(str(e)) from None
    scripted = [(ids, kinds) for kind, ids, kinds in sequences if kind in args.replay_kinds]
    torch.manual_seed(args.seed)
    head = torch.nn.Linear(model.config.hidden_size, 1)  # the match head (--match-weight); trained only with it
    if args.match_weight and args.start and (Path(args.start) / "match_head.pt").is_file():
        head.load_state_dict(torch.load(Path(args.start) / "match_head.pt"))
    rng = random.Random(args.seed)
    tuning = dataclasses.replace(settings, epochs=args.epochs, lr=args.lr, seed=args.seed)
    own, rounds = [], []
    for it in range(args.iterations):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(args.seed + it)
            played = {}
            if args.learn in ("tips", "both"):
                examples, played["tips"] = self_play_examples(model, tok, args.episodes, seed=args.seed + 1000 * it,
                                                                signature=signature)
                own += examples
            if args.learn in ("actions", "both"):
                examples, played["actions"] = reader_examples(model, tok, seed=args.seed + 1000 * it,
                                                              signature=signature, contrast=args.contrast,
                                                              distill=args.distill and args.contrast)
                own += examples
            if args.decisions:
                families = args.decision_families or in_distribution
                rounds_rng = random.Random(args.seed + 1000 * it + 7)
                states = decision_states([i for i in dev_instances(rounds_rng, args.decisions) if i[0] in families],
                                         seed=args.seed + it)
                held = decision_states([i for i in dev_instances(random.Random(args.seed + 1000 * it + 8), 1)
                                        if i[0] in families], seed=args.seed + it + 1)
                trained = states[::max(1, len(states) // 300)]  # (every k-th: what it fits on its own states)
                played["decisions"] = {"states": len(states), "held_out_before": decision_shift(model, tok, held),
                                       "trained_before": decision_shift(model, tok, trained)}
                print(f"decision states: {len(states)}; held-out shift before: {played['decisions']}", flush=True)
                own += decision_examples(model, tok, states, args.foreign_per_state, seed=args.seed + it,
                                          resigned=args.resign)
                if args.match_weight:
                    held_match = signature_match_examples(tok, held, seed=args.seed + it)
                    played["decisions"]["match_held_out_before"] = signature_match_accuracy(model, head, held_match)
                    batches = signature_match_batches(tok, states, seed=args.seed + it)

                    def auxiliary(batches=batches):
                        return args.match_weight * signature_match_loss(model, head, next(batches))
            for kind in args.foreign:
                examples, played[f"foreign_{kind}"] = reader_examples(model, tok, seed=args.seed + 1000 * it,
                                                                      foreign=kind, signature=signature,
                                                                      distill=args.distill)
                own += examples
            mix = own + rng.sample(scripted, min(len(scripted), round(args.replay * len(own))))
            played["fine_tune"] = behaviour_clone(model, mix, tuning, tok.pad_token_id,
                                                  name=f"fine-tune {it + 1}/{args.iterations}", by_length=True,
                                                  lm_weight=settings.lm_weight,
                                                  auxiliary=auxiliary if args.match_weight else None,
                                                  auxiliary_params=list(head.parameters()) if args.match_weight else ())
        if args.decisions:
            played["decisions"] |= {"held_out_after": decision_shift(model, tok, held),
                                    "trained_after": decision_shift(model, tok, trained)}
            if args.match_weight:
                played["decisions"]["match_held_out_after"] = signature_match_accuracy(model, head, held_match)
                print(f"held-out signature match, answer / fields: before "
                      f"{played['decisions']['match_held_out_before']}, after "
                      f"{played['decisions']['match_held_out_after']}", flush=True)
        rounds.append(played)
        print(json.dumps(played))
    save_cached_checkpoint(model, tok, {"probe_of": str(path), "args": vars(args), "self_play": rounds,
                                        "prompt_layout": MINISCI_TIPS_LAYOUT, "tip_signature": signature},
                           Path(args.out))
    if args.match_weight:
        torch.save(head.state_dict(), Path(args.out) / "match_head.pt")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    from empo2.cli import quiet_libraries

    quiet_libraries()  # weight-loading bars and INFO lines off, as in the CLI
    main()

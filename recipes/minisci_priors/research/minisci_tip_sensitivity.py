"""How far one tip in the prompt moves a policy's first action, by what the tip is about: exact, no sampling.

The one-tip calibration (`minisci_calibration.py --memory`) scores sampled episodes, so over 72 instances a
change of a few points is within its noise. This measures the policy's distribution instead. For each
find-living-thing training instance of that calibration (same seed, same house), the first prompt is built by
the rollout worker's own prompt builder tip-free and with one scripted tip, the calibration's kinds: the gold path's
(its own house: where the living thing is), a trapped prior-driven episode's, the gold path's of the next
instance of the family (another house) and of a power-component instance (another task). Over the valid first
actions, the policy's probabilities by teacher forcing, normalised over them (`prior_tips.action_log_probs`).
Per kind of tip: the mean probability that the first action is a `focus on` (the trap: a look-alike in the
starting room), that it is the gold path's first action, and the mean KL(tip-free || with the tip). A policy
that uses what a tip says moves far under its own house's tips and little under the others; one that reacts to
a tip block moves alike under all. The first action is often the same for every path (out of the start room), so
the same is measured where it is not: at each instance's decision state, the first where its gold path and its
trapped prior-driven path part (`prior_tips.decision_states`), the probability of the gold path's action there
tip-free, under its own gold tip, under another house's, and (signed priors) under its own gold tip re-signed with
that house's signature, word for word its own tip but about another instance (`prior_tips.decision_shift`).

    python -m recipes.minisci_priors.research.minisci_tip_sensitivity --models shipped= v7=outputs/priors/reader-v7 \\
        --out reports/minisci_priors/tip_sensitivity.json      (~1 min per model on 2 cores)

A model is LABEL=PATH: a checkpoint folder (a build's cache, a probe's --out), or an empty PATH for the shipped
reader (`model=minisci_tips_reader`).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

import torch

from empo2.config import MINISCI_HOUSE_FIELDS, ConfigError, load_config
from empo2.envs import get_catalogue, make_env
from empo2.models import load_policy
from empo2.rollout.build import build_worker, env_kwargs
from empo2.rollout.spec import collection_spec
from recipes.minisci_priors.minisci_calibration import parse_setting, scripted_episode_tip, tip_donors
from recipes.minisci_priors.prior_rounds import action_log_probs, decision_shift, decision_states
from recipes.minisci_priors.prior_tips import tips_signed

KINDS = ("gold", "trapped", "other_house", "other_task")


def first_action_shift(cfg, model, tok, tasks, seed: int, signature: bool) -> dict:
    """Per kind of tip: mean P(first action is a focus), mean P(it is the gold path's first), mean KL from the
    tip-free first-action distribution; the same two probabilities tip-free; per-instance values too."""
    worker, collection = build_worker(cfg, model, tok, 1), collection_spec(cfg)
    house = {f: getattr(cfg.env, f) for f in MINISCI_HOUSE_FIELDS}
    env = make_env("minisci", **{**env_kwargs(cfg), "max_steps": 100})
    donors = tip_donors(tasks, seed)
    rows = []
    for i, spec in enumerate(tasks):
        tips = {name: scripted_episode_tip(worker, collection, env, donors[name][i], house, name, seed, signature)[0]
                for name in KINDS}
        obs, _ = env.reset(task=spec.task, variation=spec.variation)
        actions = env.valid_actions()
        focus = torch.tensor([a.startswith("focus on ") for a in actions])
        first_gold = env.gold_actions()[0]  # (plans the house once, not per action)
        gold = torch.tensor([a == first_gold for a in actions])
        row = {}
        for name in ("tip_free", *KINDS):
            prompt = worker.builder.build(env.task_description, [], obs, None if name == "tip_free"
                                             else [tips[name]]).ids
            log_p = action_log_probs(model, tok, prompt, actions)  # (len(actions),)
            row[name] = {"mass": log_p.logsumexp(0).exp().item(), "log_p": log_p - log_p.logsumexp(0)}
        base = row["tip_free"]["log_p"]
        rows.append({name: {"focus": r["log_p"][focus].exp().sum().item(), "gold": r["log_p"][gold].exp().sum().item(),
                            "mass": r["mass"], "kl": (base.exp() * (base - r["log_p"])).sum().item()}
                     for name, r in row.items()})
    return {name: {k: statistics.fmean(r[name][k] for r in rows) for k in ("focus", "gold", "mass", "kl")}
            for name in ("tip_free", *KINDS)} | {"instances": rows}


def cells(res: dict, key: str, kinds=("tip_free", *KINDS)) -> str:
    return " / ".join(f"{res[kind][key]:.2f}" for kind in kinds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", required=True, metavar="LABEL=PATH")
    ap.add_argument("--groups", type=int, default=72, help="find-living-thing training instances (the calibration's)")
    ap.add_argument("--setting", default="num_rooms=4,num_decoys=1,num_distractors=1", help="the house")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "minisci_tip_sensitivity.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tasks = get_catalogue("minisci").sample(args.groups, "train", seed=args.seed, tasks=["find-living-thing"])
    results = {}
    print("| model | P(first action a focus): tip-free / gold / trapped / another house's gold / another task's "
          "gold | P(gold path's first action): same | KL from tip-free: gold / trapped / another house / another "
          "task | at the decision state, P(gold action): tip-free / own gold / another house's gold / own gold "
          "re-signed |"
          "\n|---|---|---|---|---|")
    for item in args.models:
        label, sep, path = item.partition("=")
        if not sep:
            raise SystemExit(f"--models {item}: give LABEL=PATH (an empty PATH for the shipped reader)")
        overrides = ["model.name=hf", f"model.path={path}", "model.dtype=float32"] if path else []
        cfg = load_config(["model=minisci_tips_reader", "env=minisci", f"seed={args.seed}", "algo.p=1",
                           *parse_setting(args.setting), *overrides])
        try:
            model, tok = load_policy(cfg.model)
        except ConfigError as e:  # a wrong path: one line naming it
            raise SystemExit(f"--models {item}: {e}") from None
        model.eval()
        signed = bool(path) and tips_signed(path)
        res = first_action_shift(cfg, model, tok, tasks, args.seed, signed)
        house = {f: getattr(cfg.env, f) for f in MINISCI_HOUSE_FIELDS}
        states = decision_states([(spec.task, spec.variation, house) for spec in tasks], cfg.env.max_steps, args.seed)
        res["decision"] = decision_shift(model, tok, states, args.seed, signed)
        results[label] = {"path": path, **res}
        resigned = f"{res['decision']['resigned']['gold']:.2f}" if signed else "–"  # (unsigned tips: no signature)
        print(f"| {label} | {cells(res, 'focus')} | {cells(res, 'gold')} | {cells(res, 'kl', KINDS)} | "
              f"{cells(res['decision'], 'gold', ('tip_free', 'own', 'other_house'))} / {resigned} |", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": platform.platform(), "args": vars(args), "models": results}, indent=2))
    print(f"means over {args.groups} instances; wrote {out}")


if __name__ == "__main__":
    from empo2.utils import quiet_libraries

    quiet_libraries()
    main()

"""How hard MiniSci is for a policy, per house difficulty and family: the numbers used to size a CPU experiment.

For each difficulty setting (`--settings`, each a comma list of env overrides such as
`num_rooms=4,num_decoys=1`) and each family, group rollouts of training variations are played by

- `random`: a uniformly random valid action at every step (no model), and
- `policy`: the configured LLM through the real rollout worker (memory off, training temperature).

Per (setting, family, player) the table gives the mean score (0-100), the success rate, the share of
episodes that end on a wrong `focus on`, and, the number that decides whether group-relative RL
can learn at all, the share of groups whose rollouts do not all score the same (a group with equal
returns has zero advantage everywhere and teaches nothing). Prints a table and writes JSON.

    python -m recipes.minisci_priors.minisci_calibration [--model smollm2|minisci_bc] [--groups 4] [--group-size 4]
        [--max-steps 8] [--settings "" "num_rooms=4,num_decoys=1"] [--families find-living-thing]

With `--memory` it measures instead whether the policy's memory abilities are live (no weight update), per
family on training variations: `--groups` instances played `--rounds` times one after the other, each
round retrieving (p = 1) only the tips the policy itself wrote after the earlier rounds of the same
instance; round 0 has an empty memory, so it is the tip-free score. Also the share of its own tips that
state a task-relevant thing's true room (and claim no false one), the share that are exactly the hindsight tip
its episode supports (`recipes.minisci_priors.prior_tips.hindsight_tip` of its actions replayed: what it saw where,
the focus that failed, the score), and the score when the memory holds only irrelevant tips (those it wrote for the next
instance of the family), and, to tell reading tips from writing them, the score with one scripted episode's
hindsight tip per instance instead of its own: the gold path's (true, locating what the task needs), a trapped
prior-driven episode's (which look-alike failed), and, to tell what a tip says from that a tip is there, the gold
path's tip of another house of the family and of an instance of another family; and how many episodes begin
with a `focus on`, tip-free and under each scripted tip (with how many begin by going to a room the tip names).
For a prior that signs its tips (`prior_tips.tips_signed`), also the share of its own tips that open with their
instance's signature, and the irrelevant tips' change apart from the instances whose borrowed tips open with
their own signature (a slip of the writer, or a task with the same signature: no reader can tell those apart),
and the next instance's tips' changes apart from the instances whose next instance's task has their signature.

    python -m recipes.minisci_priors.minisci_calibration --model minisci_tips --memory --groups 24 --rounds 5

With a tip-free score of a few points, 10% of it is a fraction of one episode's score over a few dozen instances;
`--pool` joins the records of runs with other `--seed` values (other instances) and gives the verdicts over all
of them:

    python -m recipes.minisci_priors.minisci_calibration --pool RUN_SEED0.json RUN_SEED1.json ... --out POOLED.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from scipy.stats import binomtest

from empo2.algo.stats import bootstrap_ci
from empo2.config import MINISCI_HOUSE_FIELDS, load_config
from empo2.envs import get_catalogue, make_env
from empo2.envs.minisci import FAMILIES
from empo2.envs.minisci.env import build
from empo2.envs.minisci.layout import Difficulty
from empo2.memory import TipMemory
from empo2.models import load_policy
from empo2.models.io import checkpoint_folder
from empo2.rollout.build import build_worker, env_kwargs
from empo2.rollout.spec import collection_spec
from recipes.minisci_priors.prior_rounds import replay
from recipes.minisci_priors.prior_tips import SIGNATURE_HEAD, hindsight_tip, play, scripted, tips_signed


def parse_setting(text: str) -> list[str]:
    return [f"env.{kv.strip()}" for kv in text.split(",") if kv.strip()]


def summarise(scores: list[list[float]], wrong_focus: int, seconds: float) -> dict:
    """scores: one list of episode scores per group."""
    flat = [s for group in scores for s in group]
    return {
        "episodes": len(flat),
        "mean_score": statistics.fmean(flat),
        "success": sum(s == 100 for s in flat) / len(flat),
        "wrong_focus": wrong_focus / len(flat),
        "groups_with_signal": sum(len(set(g)) > 1 for g in scores) / len(scores),
        "seconds_per_episode": seconds / len(flat),
    }


def play_random(cfg, tasks, group_size: int, seed: int) -> dict:
    rng = random.Random(seed)
    env = make_env("minisci", **env_kwargs(cfg))
    scores, wrong, t0 = [], 0, time.perf_counter()
    for spec in tasks:
        group = []
        for _ in range(group_size):
            env.reset(task=spec.task, variation=spec.variation)
            info = {"score": 0, "failed": False}
            for _ in range(cfg.env.max_steps):
                result = env.step(rng.choice(env.valid_actions()))
                info = result.info
                if result.done:
                    break
            group.append(float(info["score"]))
            wrong += bool(info["failed"])
        scores.append(group)
    return summarise(scores, wrong, time.perf_counter() - t0)


def play_policy(cfg, model, tok, tasks, group_size: int, seed: int) -> dict:
    worker = build_worker(cfg, model, tok, len(tasks) * group_size)
    t0 = time.perf_counter()
    batch = worker.collect(collection_spec(cfg), tasks, group_size, iteration=0,
                           generator=torch.Generator().manual_seed(seed))
    seconds = time.perf_counter() - t0
    by_group: dict[int, list[float]] = {}
    for tr in batch.trajectories:
        by_group.setdefault(tr.group_id, []).append(float(tr.score))
    # A MiniSci episode ends before its step budget only when it is won or failed (a wrong focus).
    wrong = sum(tr.length < cfg.env.max_steps and not tr.won for tr in batch.trajectories)
    out = summarise(list(by_group.values()), wrong, seconds)
    out["invalid_action_frac"] = batch.stats["rollout/invalid_action_frac"]
    return out


def first_moves(trajs, tok, tips: list[str] | None = None) -> dict:
    """How many episodes begin with a `focus on` (on find-living-thing the trap waits in or next to the starting
    room, so a reader that focuses at once has mostly taken it) and, given the one tip each instance's memory
    holds, how many begin by going to a room that tip names: whether a tip changes the first move by what it
    says or by being there."""
    firsts = [tok.decode(tr.samples[0].response_ids, skip_special_tokens=True).strip() if tr.samples else ""
              for tr in trajs]
    out = {"first_focus": sum(f.startswith("focus on") for f in firsts)}
    if tips is not None:
        out["first_to_named"] = sum(f.startswith("go to ") and f" in the {f[len('go to '):]}" in tip
                                    for f, tip in zip(firsts, tips))
    return out


def tip_is_true(tip: str | None, true_rooms: dict[str, str]) -> bool:
    """The tip places at least one thing the house hides (`Task.sought`), and every such thing it places is
    where it is."""
    if not tip:
        return False
    claims = {thing: room for thing, room in true_rooms.items() if f"{thing} in the " in tip}
    return bool(claims) and all(f"{thing} in the {room}" in tip for thing, room in claims.items())


def play_memory(cfg, model, tok, tasks, rounds: int, seed: int, show: int = 0, signature: bool = False) -> dict:
    """Memory-only adaptation of one family: score per round with the policy's own tips, tip truth and
    exactness, the score with irrelevant tips only, and with one scripted tip per instance (gold / trapped).
    `signature`: the policy learned tips that open with their task's signature (`prior_tips.tips_signed`), so
    the tip its episode supports and the scripted tips do too."""

    worker, spec = build_worker(cfg, model, tok, len(tasks)), collection_spec(cfg)
    scores, success, wrong_focus, truths, exact, t0 = [], [], [], [], [], time.perf_counter()
    house = {f: getattr(cfg.env, f) for f in MINISCI_HOUSE_FIELDS}
    difficulty = Difficulty(**house)
    replay_env = make_env("minisci", **{**env_kwargs(cfg), "max_steps": 100})
    true_rooms, signed = [], []  # signed: how a tip about each instance opens (`prior_tips.hindsight_tip`)
    for spec in tasks:
        world, task = build(spec.task, spec.variation, difficulty)
        true_rooms.append({thing: world.room_of(thing) for thing in task.sought})
        signed.append(f"{SIGNATURE_HEAD}{task.signature}.")
    signed_right = []
    for r in range(rounds):
        batch = worker.collect(spec, tasks, 1, iteration=r, generator=torch.Generator().manual_seed(seed + r))
        trs = batch.trajectories
        if r == 0:
            tip_free_first = first_moves(trs, tok)["first_focus"]
        scores.append([tr.score for tr in trs])
        success.append(statistics.fmean(tr.won for tr in trs))
        wrong_focus.append(statistics.fmean(tr.length < cfg.env.max_steps and not tr.won for tr in trs))
        truths += [tip_is_true(tr.tip, rooms) for tr, rooms in zip(trs, true_rooms)]
        signed_right += [bool(tr.tip) and tr.tip.startswith(head) for tr, head in zip(trs, signed)]
        for spec, tr in zip(tasks, trs):  # the tip the episode supports, from its actions replayed
            ep = replay(replay_env, spec.task, spec.variation, house, tr, tok, cfg.env.max_steps)
            exact.append(ep is not None and tr.tip == hindsight_tip(ep, signature))
        for spec, tr in list(zip(tasks, trs))[:show]:  # what the numbers come from: actions and the tip written
            actions = [tok.decode(s.response_ids, skip_special_tokens=True).strip() for s in tr.samples]
            print(f"  round {r} {spec.task}/{spec.variation}: score {tr.score:.0f}, actions {actions}, tip {tr.tip!r}")
    # irrelevant tips only: each instance's namespace gets the tips written for the next instance
    own = worker.memory
    foreign = TipMemory(own.dim, **{k: v for k, v in own.config().items() if k != "dim"})
    # whether any of them opens with this instance's own signature, as written (the writer's slip, when the
    # donor's signature differs) or rightly (two instances whose tasks share a signature): no reader can tell
    # such a tip from its own
    claims_own = []
    for i, spec in enumerate(tasks):
        donor = tasks[(i + 1) % len(tasks)]
        ids = [rec.id for rec in own.records() if (rec.task, rec.variation) == (donor.task, donor.variation)]
        texts = []
        if ids:
            texts, vectors, metas = own.export(ids)
            foreign.add(texts, vectors, [dict(m, task=spec.task, variation=spec.variation) for m in metas])
        claims_own.append(signature and any(t.startswith(signed[i]) for t in texts))
    reading = collection_spec(cfg, write_tips=False)
    batch = worker.using(memory=foreign).collect(reading, tasks, 1, iteration=rounds,
                                                 generator=torch.Generator().manual_seed(seed))
    scripted = scripted_tip_scores(worker, reading, tasks, replay_env, house, seed, own, tok, signature)
    return {**scripted, "episodes": len(tasks) * rounds, "tip_free_first_focus": tip_free_first,
            "score_by_round": [statistics.fmean(r) for r in scores],
            "scores": scores, "irrelevant_scores": [tr.score for tr in batch.trajectories],
            "success_by_round": success,
            "wrong_focus_by_round": wrong_focus, "tip_truth": statistics.fmean(truths) if truths else 0.0,
            "tips_exact": statistics.fmean(exact) if exact else 0.0,
            "tips_signed_right": statistics.fmean(signed_right) if signature and signed_right else None,
            "irrelevant_claims_own": claims_own,
            # the next instance's task has this one's signature (find-living-thing's names the box and its room, not
            # the category): its tips, rightly signed, claim to be this instance's
            "irrelevant_same_signature": [signature and signed[i] == signed[(i + 1) % len(tasks)]
                                          for i in range(len(tasks))],
            "irrelevant_tips_score": batch.stats["rollout/score"],
            "memory_frac_irrelevant": batch.stats["rollout/memory_frac"],
            "seconds": time.perf_counter() - t0}


def tip_donors(tasks, seed: int) -> dict:
    """Per kind of scripted tip, the instance whose episode gives each of `tasks` its tip: its own (`gold`,
    `trapped`), the next instance of the family (`other_house`), an instance of the next in-distribution family
    (`other_task`; None for a family outside them)."""
    from empo2.envs.minisci import FAMILIES, OOD_FAMILIES

    families = [f for f in FAMILIES if f not in OOD_FAMILIES]
    other = families[(families.index(tasks[0].task) + 1) % len(families)] if tasks[0].task in families else None
    return {"gold": tasks, "trapped": tasks, "other_house": tasks[1:] + tasks[:1],
            "other_task": get_catalogue("minisci").sample(len(tasks), "train", seed=seed, tasks=[other])
            if other else None}


def scripted_episode_tip(worker, collection, env, spec, house: dict, name: str, seed: int,
                         signature: bool = False):
    """(hindsight tip, key text as the rollout worker keys its own under `collection`, score) of one scripted
    episode of `spec` in `house`: the gold path's, or with `name` "trapped" the prior-driven agent's
    (`prior_tips.scripted`)."""
    env.reset(task=spec.task, variation=spec.variation)
    actions = env.gold_actions() if name != "trapped" else scripted(random.Random(seed), trap=True)
    ep = play(env, spec.task, spec.variation, house, actions, worker.max_episode_steps)
    return hindsight_tip(ep, signature), worker.retrieval_key(collection, env, ep.turns, ep.final_obs), ep.score


def scripted_tip_scores(worker, collection, tasks, env, house: dict, seed: int, like, tok,
                        signature: bool = False) -> dict:
    """Whether it acts well on tips it did not write: the score with one scripted episode's hindsight tip per
    instance in memory. `gold`: the gold path's (true, locating everything the task needs); `trapped`: a
    prior-driven trapped episode's (what it saw on the way, which look-alike failed); each keyed as the rollout
    worker keys its own (the episode's final state). Separates reading tips from writing them. And two tips that are not
    about this instance, keyed as its own gold path's tip (so retrieval finds them as it would its own):
    `other_house`, the gold path's tip of the next instance of the family (another house: a tip that reads like a
    true one and is wrong here), and `other_task`, the gold path's tip of an instance of another family (about
    another task: nothing in it applies). Per kind also the first moves (`first_moves`)."""
    from empo2.memory import TipMemory

    out = {}
    for name, donor_specs in tip_donors(tasks, seed).items():
        if donor_specs is None:
            continue
        memory = TipMemory(like.dim, **{k: v for k, v in like.config().items() if k != "dim"})
        texts, keys, metas = [], [], []
        for spec, donor in zip(tasks, donor_specs):
            text, key, score = scripted_episode_tip(worker, collection, env, donor, house, name, seed, signature)
            if name not in ("gold", "trapped"):
                key = scripted_episode_tip(worker, collection, env, spec, house, "gold", seed, signature)[1]
            texts.append(text)
            keys.append(key)
            metas.append({"task": spec.task, "variation": spec.variation, "episode_return": score / 100})
        memory.add(texts, worker.embedder.encode(keys), metas)
        batch = worker.using(memory=memory).collect(collection, tasks, 1, iteration=0,
                                                    generator=torch.Generator().manual_seed(seed))
        out[f"{name}_tip_scores"] = [tr.score for tr in batch.trajectories]
        out[f"{name}_tip_score"] = batch.stats["rollout/score"]
        out[f"{name}_tip_memory_frac"] = batch.stats["rollout/memory_frac"]
        out.update({f"{name}_tip_{k}": v for k, v in first_moves(batch.trajectories, tok, texts).items()})
    return out


def paired_change(pair: np.ndarray, seed: int) -> tuple[float, float, float]:
    """The mean change from column 0 to column 1 of (instances, 2) paired scores, with its bootstrap interval."""
    return bootstrap_ci(pair, stat=lambda d: d[:, 1].mean() - d[:, 0].mean(), seed=seed)


TRAP_MAX_SUCCESS, DOUBLING, IRRELEVANT_BOUND = 0.25, 2.0, 0.1  # the three calibration targets (docs/priors.md)


def verdict(point_holds: bool, interval_holds: bool) -> str:
    """A target "holds" only when its whole 95% interval meets it; met by the point estimate alone it is "point
    estimate only"; otherwise it "misses"."""
    return "holds" if interval_holds else "point estimate only" if point_holds else "misses"


def success_interval(rate: float, n: int) -> tuple[float, float, float]:
    """(rate, low, high): the 95% Wilson score interval of a success rate over n instances (scipy)."""
    k = round(rate * n)  # rates are counts over instances
    ci = binomtest(k, n).proportion_ci(0.95, method="wilson")
    return k / n, float(ci.low), float(ci.high)


def memory_verdicts(res: dict, family: str, seed: int = 0) -> dict:
    """The prior's targets on one family, with paired bootstrap intervals over instances: tip-free success
    (find-living-thing <= 25%, Wilson interval), own tips after 2 episodes >= 2x the tip-free score, irrelevant
    tips within 10% of tip-free (the mean score's change). `targets` holds each target's verdict (`verdict`) with
    the interval it rests on and its method."""
    scores = np.array(res["scores"], dtype=float).T  # (instances, rounds)
    tip_free = scores[:, 0]
    out = {"tip_free": bootstrap_ci(tip_free, seed=seed)}
    if scores.shape[1] > 2:
        pair = np.stack([tip_free, scores[:, 2]], axis=1)  # (instances, 2)
        out["after_2"] = bootstrap_ci(scores[:, 2], seed=seed)
        # the ratio of means; with a tip-free mean of 0 any gain is an infinite ratio
        out["ratio_after_2"] = bootstrap_ci(pair, stat=lambda d: d[:, 1].mean() / max(d[:, 0].mean(), 1e-9),
                                            seed=seed)
    bound = IRRELEVANT_BOUND * max(tip_free.mean(), 1e-9)
    # the policy's own tips of the next instance; scripted tips of another house and of another task (no other
    # family: none)
    for name, key in (("irrelevant", "irrelevant_scores"), ("other_house", "other_house_tip_scores"),
                      ("other_task", "other_task_tip_scores")):
        if key in res:
            pair = np.stack([tip_free, np.array(res[key], dtype=float)], axis=1)  # (instances, 2)
            out[f"{name}_change"] = paired_change(pair, seed)
    if any(res.get("irrelevant_claims_own", [])):  # the change apart from irrelevant tips that claim to be its own
        claims = np.array(res["irrelevant_claims_own"], dtype=bool)
        pair = np.stack([tip_free, np.array(res["irrelevant_scores"], dtype=float)], axis=1)[~claims]
        out["irrelevant_claiming_own"] = int(claims.sum())
        if len(pair):
            out["irrelevant_change_signed_other"] = paired_change(pair, seed)
    if any(res.get("irrelevant_same_signature", [])):  # the next instance's tips, apart from those no reader can tell
        same = np.array(res["irrelevant_same_signature"], dtype=bool)
        out["next_instance_same_signature"] = int(same.sum())
        for name, key in (("irrelevant", "irrelevant_scores"), ("other_house", "other_house_tip_scores")):
            if key in res and (~same).any():
                pair = np.stack([tip_free, np.array(res[key], dtype=float)], axis=1)[~same]  # (instances, 2)
                out[f"{name}_change_other_signature"] = paired_change(pair, seed)
    out["targets"] = targets = {}
    if family == "find-living-thing":
        rate, low, high = success_interval(res["success_by_round"][0], len(tip_free))
        targets["trap"] = {"verdict": verdict(rate <= TRAP_MAX_SUCCESS, high <= TRAP_MAX_SUCCESS),
                           "interval": [rate, low, high], "method": "Wilson score, 95%, over instances"}
    if "ratio_after_2" in out:
        ratio, low, _ = out["ratio_after_2"]
        after = scores[:, 2].mean()
        targets["doubling"] = {"verdict": verdict(ratio >= DOUBLING and after > 0, low >= DOUBLING and after > 0),
                               "interval": list(out["ratio_after_2"]),
                               "method": "percentile bootstrap, 95%, paired over instances"}
    if "irrelevant_change" in out:
        change, low, high = out["irrelevant_change"]
        targets["irrelevant"] = {"verdict": verdict(abs(change) <= bound, -bound <= low and high <= bound),
                                 "interval": list(out["irrelevant_change"]), "bound": bound,
                                 "method": "percentile bootstrap, 95%, paired over instances"}
    return out


def targets_text(v: dict) -> str:
    """One line: each target's verdict."""
    names = {"trap": "trap holds (success <= 25%)", "doubling": "own tips double the score",
             "irrelevant": "irrelevant tips within 10%"}
    return "; ".join(f"{names[k]}: {t['verdict']}" for k, t in v["targets"].items())


def pooled_memory(rows: list[dict]) -> dict:
    """One family's `--memory` rows from runs of other seeds (other instances, other samples) as one run over
    all their instances: per-instance lists joined, per-round rates weighted by instance count."""
    n = [len(r["scores"][0]) for r in rows]
    rounds = range(len(rows[0]["scores"]))
    out = {"instances": sum(n), "scores": [sum((r["scores"][k] for r in rows), []) for k in rounds],
           "success_by_round": [float(np.average([r["success_by_round"][k] for r in rows], weights=n))
                                for k in rounds]}
    for key in ("variations", "irrelevant_scores", "other_house_tip_scores", "other_task_tip_scores",
                "irrelevant_claims_own", "irrelevant_same_signature"):
        if all(key in r for r in rows):
            out[key] = sum((r[key] for r in rows), [])
    return out


def main_pool(args) -> None:
    """`--pool`: the verdicts of `--memory` records of one prior and settings but other seeds, pooled."""
    records = []
    for path in args.pool:
        try:
            records.append(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"--pool {path}: cannot read a calibration record ({e})") from None

    def setup(rec: dict) -> dict:  # what must agree (`pool` is absent from records written before it existed)
        return {k: v for k, v in rec["args"].items() if k not in ("seed", "out", "pool")}

    for path, rec in zip(args.pool, records):
        if not rec["args"].get("memory") or setup(rec) != setup(records[0]):
            raise SystemExit(f"--pool {path}: not a --memory record of the same prior and settings as {args.pool[0]} "
                             "(only --seed and --out may differ)")
    seeds = [rec["args"]["seed"] for rec in records]
    if len(set(seeds)) < len(seeds):
        raise SystemExit(f"--pool: seeds {seeds} repeat; a seed's instances would count twice")
    keys = [(r["setting"], r["family"]) for r in records[0]["rows"]]
    rows = []
    cat = get_catalogue("minisci")
    for setting, family in keys:
        for rec in records:  # records written before they kept their instances: drawn again as they were drawn
            for r in rec["rows"]:
                if "variations" not in r and (r["setting"], r["family"]) == (setting, family):
                    r["variations"] = [s.variation for s in cat.sample(rec["args"]["groups"], "train",
                                                                       seed=rec["args"]["seed"], tasks=[family])]
        res = pooled_memory([r for rec in records for r in rec["rows"]
                             if (r["setting"], r["family"]) == (setting, family)])
        res["distinct_instances"] = len(set(res["variations"]))
        res["verdicts"] = v = memory_verdicts(res, family)
        rows.append({"setting": setting, "family": family, "seeds": seeds, **res})
        said = [f"tip-free {ci_text(v['tip_free'])}, success {res['success_by_round'][0]:.2f}"]
        if "ratio_after_2" in v:
            said.append(f"own tips after 2 {ci_text(v['ratio_after_2'], 'x')}")
        for name, what in (("irrelevant", "irrelevant tips"), ("other_house", "another house's gold tip"),
                           ("other_task", "another task's gold tip")):
            if f"{name}_change" in v:
                said.append(f"{what} {ci_text(v[name + '_change'], signed=True)}")
        if "next_instance_same_signature" in v:
            apart = [f"{what} {ci_text(v[name + '_change_other_signature'], signed=True)}" for name, what in
                     (("irrelevant", "irrelevant tips"), ("other_house", "another house's gold tip"))
                     if name + "_change_other_signature" in v]
            said.append(f"apart from the {v['next_instance_same_signature']} whose next instance's task has their "
                        f"signature: {', '.join(apart)}")
        if "irrelevant_claiming_own" in v:
            said.append(f"apart from the {v['irrelevant_claiming_own']} whose irrelevant tips open with their own "
                        f"signature: {ci_text(v['irrelevant_change_signed_other'], signed=True)}")
        print(f"{setting} {family}, {res['instances']} instances ({res['distinct_instances']} distinct) of "
              f"{len(records)} seeds: " + "; ".join(said))
        print(f"  targets: {targets_text(v)}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"pooled": args.pool, "rows": rows}, indent=2))
    print(f"intervals: 95% paired percentile bootstrap over the pooled instances (success: Wilson)\nwrote {out}")


def main_memory(args) -> None:
    base = [f"model={args.model}", "algo.p=1", "algo.q=0", "algo.beta_start=0", "algo.beta_end=0",
            f"env.max_steps={args.max_steps}", "rollout.max_new_tokens=16", "rollout.tip_max_new_tokens=64",
            f"seed={args.seed}", f"rollout.temperature={args.temperature}",
            f"rollout.tip_temperature={args.tip_temperature}", *args.override]
    model_cfg = load_config(base).model
    model, tok = load_policy(model_cfg)
    model.eval()
    folder = checkpoint_folder(model_cfg)  # a shipped prior's or model.path: hand-made tips take its format
    signature = folder is not None and tips_signed(folder)
    cat = get_catalogue("minisci")
    rows, signing = [], []
    print("| setting | family | tip-free score | success | wrong focus | own tips after 1 / 2 / 4 episodes | "
          "after 2 / tip-free | tips true | tips exact | irrelevant tips (change) | gold tip / trapped tip | "
          "another house's gold tip (change) | another task's gold tip (change) | "
          "first move a focus: tip-free / another task's tip |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for setting in args.settings:
        cfg = load_config(base + parse_setting(setting))
        for family in args.families:
            tasks = cat.sample(args.groups, "train", seed=args.seed, tasks=[family])
            res = play_memory(cfg, model, tok, tasks, args.rounds, args.seed, args.show, signature)
            res["variations"] = [spec.variation for spec in tasks]  # instances may repeat within and across seeds
            res["verdicts"] = v = memory_verdicts(res, family, args.seed)
            rows.append({"setting": setting or "default", "family": family, **res})
            c = res["score_by_round"]
            after = " / ".join(f"{c[k]:.1f}" if k < len(c) else "-" for k in (1, 2, 4))
            ratio = "-" if "ratio_after_2" not in v else ci_text(v["ratio_after_2"], "x")
            print(f"| {setting or 'default'} | {family} | {ci_text(v['tip_free'])} | "
                  f"{res['success_by_round'][0]:.2f} | "
                  f"{res['wrong_focus_by_round'][0]:.2f} | {after} | {ratio} | {res['tip_truth']:.2f} | "
                  f"{res['tips_exact']:.2f} | {res['irrelevant_tips_score']:.1f} "
                  f"({ci_text(v['irrelevant_change'], signed=True)}) | "
                  f"{res['gold_tip_score']:.1f} / {res['trapped_tip_score']:.1f} | "
                  f"{scripted_change(res, v, 'other_house')} | {scripted_change(res, v, 'other_task')} | "
                  f"{res['tip_free_first_focus']} / {res.get('other_task_tip_first_focus', '-')} of {len(tasks)} |",
                  flush=True)
            if res["tips_signed_right"] is not None:  # said under the table, which it would break
                split = ""
                if "irrelevant_change_signed_other" in v:
                    rest = ci_text(v["irrelevant_change_signed_other"], signed=True)
                    split = f"; the change apart from those {rest} over {len(tasks) - v['irrelevant_claiming_own']}"
                signing.append(f"{family}: own tips signed with their instance's signature "
                               f"{res['tips_signed_right']:.0%}; irrelevant tips opening with the instance's own "
                               f"signature in {v.get('irrelevant_claiming_own', 0)} of {len(tasks)} (the next "
                               f"instance's task has its signature in {sum(res['irrelevant_same_signature'])}){split}")
    for line in signing:
        print(line)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": platform.platform(), "threads": args.threads, "args": vars(args),
                               "rows": rows}, indent=2))
    print(f"intervals: 95% paired bootstrap over the {args.groups} instances of a family\nwrote {out}")


def scripted_change(res: dict, verdicts: dict, name: str) -> str:
    if f"{name}_change" not in verdicts:
        return "-"
    return f"{res[name + '_tip_score']:.1f} ({ci_text(verdicts[name + '_change'], signed=True)})"


def ci_text(ci: tuple[float, float, float], unit: str = "", signed: bool = False) -> str:
    fmt = "{:+.1f}" if signed else "{:.1f}"
    return f"{fmt.format(ci[0])}{unit} [{fmt.format(ci[1])}, {fmt.format(ci[2])}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="a conf/model group: smollm2, minisci_bc, tiny")
    ap.add_argument("--settings", nargs="+", default=["", "num_rooms=4,num_decoys=1,num_distractors=1"],
                    help='house overrides per setting, e.g. "num_rooms=4,num_decoys=0"; "" is the default house')
    ap.add_argument("--families", nargs="+", default=[f for f in FAMILIES if f != "change-state"])
    ap.add_argument("--groups", type=int, default=4, help="task instances per family (train split)")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-steps", type=int, default=8)
    ap.add_argument("--random-groups", type=int, default=50, help="task instances per family for the random player")
    ap.add_argument("--no-policy", action="store_true", help="random player only")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--memory", action="store_true", help="memory-only adaptation with the policy's own tips")
    ap.add_argument("--temperature", type=float, default=1.0,
                    help="with --memory: acting temperature (1.0, the training temperature, is what RL starts from; "
                         "tips are always written at 1.0, as in training)")
    ap.add_argument("--tip-temperature", type=float, default=1.0,
                    help="with --memory: sampling temperature of the tips the policy writes (0: greedy)")
    ap.add_argument("--override", nargs="+", default=[],
                    help="more config overrides, last (e.g. model.name=hf model.path=DIR)")
    ap.add_argument("--rounds", type=int, default=5, help="with --memory: episodes per instance, one after another")
    ap.add_argument("--show", type=int, default=0, help="with --memory: print the actions and tip of this many "
                                                        "instances per round")
    ap.add_argument("--pool", nargs="+", default=None, metavar="RECORD",
                    help="pool --memory records of one prior and settings run with other --seed values (other "
                         "instances) and print the verdicts over all their instances; plays nothing")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/minisci_calibration"
                                                "[_memory].json)")
    args = ap.parse_args()
    if args.pool:
        if not args.out:
            ap.error("--pool writes its verdicts to --out; give one")
        main_pool(args)
        return
    torch.set_num_threads(args.threads)
    name = "minisci_calibration_memory.json" if args.memory else "minisci_calibration.json"
    args.out = args.out or str(Path(__file__).parent / "results" / name)
    if args.memory:
        main_memory(args)
        return

    base = [f"model={args.model}", "memory.enabled=false", "algo.p=0",
            f"env.max_steps={args.max_steps}", "rollout.max_new_tokens=16", *args.override]
    model = tok = None
    if not args.no_policy:
        model, tok = load_policy(load_config(base).model)
        model.eval()
    cat = get_catalogue("minisci")
    rows = []
    for setting in args.settings:
        cfg = load_config(base + parse_setting(setting))
        for family in args.families:
            for player in ("random",) + (() if args.no_policy else ("policy",)):
                n = args.random_groups if player == "random" else args.groups
                tasks = cat.sample(n, "train", seed=args.seed, tasks=[family])
                res = (play_random(cfg, tasks, args.group_size, args.seed) if player == "random" else
                       play_policy(cfg, model, tok, tasks, args.group_size, args.seed))
                rows.append({"setting": setting or "default", "family": family, "player": player, **res})
                r = rows[-1]
                print(f"| {r['setting']} | {family} | {player} | {r['mean_score']:.1f} | {r['success']:.2f} | "
                      f"{r['wrong_focus']:.2f} | {r['groups_with_signal']:.2f} | {r['seconds_per_episode']:.3f} |",
                      flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": platform.platform(), "processor": platform.processor(),
                               "threads": args.threads, "args": vars(args), "rows": rows}, indent=2))
    print(f"columns: setting | family | player | mean score | success | wrong focus | groups with signal | "
          f"s/episode\nwrote {out}")


if __name__ == "__main__":
    from empo2.utils import quiet_libraries

    quiet_libraries()  # weight-loading bars and INFO lines off, as in the CLI
    main()

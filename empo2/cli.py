"""The `empo2` command. Each subcommand parses its own arguments and hands a validated config to a
plain Python function (`train(cfg)`, ...), so everything the CLI does is also a library call.

User mistakes (a bad config value, a missing model) print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import sys
import time
from pathlib import Path

from empo2.config import ConfigError
from empo2.utils import pause_gc_for_startup, quiet_libraries, thaw_startup_heap

STARTED = time.perf_counter()  # before torch, Lightning and the config's composition: `empo2 train`'s start-up

# The interpreter's exit tears down every module: with the million objects torch, transformers and Lightning make,
# automatic collections during that teardown cost 0.4 of the 1.7 CPU-s a training process spends exiting here. Its
# own final collection still runs (libraries check at their exit that their objects were freed). Registered when
# the CLI is imported, before torch, Lightning and MLflow register theirs, so it runs after those.
atexit.register(gc.disable)

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")  # its database-migration INFO lines are not ours
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded at run time
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SUBCOMMANDS = {
    "train": "train a policy: `empo2 train [experiment=PRESET] [hydra overrides, e.g. algo.p=0.4 env=scienceworld]`",
    "eval": "score a checkpoint per task: `empo2 eval ckpt=RUN_OR_CKPT [memory=on|off|both] [split=test] "
            "[variations=N] [rollouts=N] [tasks=a,b] [out=DIR] [overrides]`",
    "adapt": "memory-only adaptation to unseen tasks, no parameter updates: `empo2 adapt [ckpt=...] [trials=K] "
             "[split=test] [variations=N] [rollouts=N] [tasks=a,b] [out=DIR] [overrides]`",
    "grid": "run every preset x seed of a grid file: `empo2 grid grids/ablations.yaml --seeds 3 [--workers N] "
            "[--launcher slurm] [--status]`",
    "sweep": "Optuna study over a search space: `empo2 sweep sweeps/NAME.yaml [--workers N] [--launcher slurm]`",
    "compare": "table and learning curves of an MLflow experiment: "
               "`empo2 compare --experiment NAME [--group-by preset|trial|TAG]`",
    "models": "list the policy presets and whether each is available on this machine",
    "config": "list the config groups and their options, every field of one, or the presets: "
              "`empo2 config [GROUP|train|experiment]`",
}


def _cmd_train(args: argparse.Namespace) -> int:
    pause_gc_for_startup()  # until the run's first rollout; main() thaws what it froze (`empo2.utils`)
    from empo2.config import load_config
    from empo2.workflows.train import train

    cfg = load_config(args.overrides)
    if args.cfg:  # the resolved config of this command line, nothing run
        from omegaconf import OmegaConf

        from empo2.config import to_dict

        print(OmegaConf.to_yaml(to_dict(cfg)), end="")
        return 0
    summary = _interruptible(lambda: train(cfg, started=STARTED), cfg, args.overrides)
    # one upload and one report per run, not per rank: every process of a multi-process run has RANK by now,
    # whatever started it (`export_ranks`)
    if os.environ.get("RANK", "0") != "0":
        return 0
    from empo2.workflows.launch import log_run_files

    log_run_files(summary)  # config as MLflow params, curve and summary.json as artifacts
    print_report(summary)
    return 0


def interrupt(signum=None, frame=None):
    """The SIGINT handler of `empo2 train`: raises Interrupted (a second Ctrl-C then stops at once), but not in
    the middle of a checkpoint write, which finishes first (`utils.uninterrupted`)."""
    import signal

    from empo2.utils import hold_interrupt, record_interrupt
    from empo2.utils.errors import Interrupted

    if hold_interrupt(interrupt):
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    error = Interrupted()
    record_interrupt(error)  # raised again where the iteration ends, should a finalizer swallow it
    raise error


def _interruptible(run, cfg, overrides: list[str]):
    """`run()` with Ctrl-C turned into a report: the last finished iteration, its checkpoint and the exact
    command that resumes the run; exit status 130. A second Ctrl-C stops at once."""
    import signal

    from empo2.utils import record_interrupt
    from empo2.utils.errors import Interrupted

    def quiet_when_interrupted(unraisable):  # the swallowed interrupt comes back at the iteration's end
        if not isinstance(unraisable.exc_value, Interrupted):
            previous_hook(unraisable)

    previous, previous_hook = signal.signal(signal.SIGINT, interrupt), sys.unraisablehook
    sys.unraisablehook = quiet_when_interrupted
    try:
        return run()
    except Interrupted as e:
        run_dir = getattr(e, "run_dir", None)  # set by train() once the run folder exists
        ckpt = _last_checkpoint(run_dir) if run_dir is not None else None
        print("\ninterrupted", file=sys.stderr)
        if ckpt is None:
            print("  no iteration finished: nothing to resume", file=sys.stderr)
            raise SystemExit(130) from None
        path, iteration = ckpt
        kept = [o for o in overrides if not o.startswith(("run_name=", "resume="))]
        name = run_dir.relative_to(Path(cfg.run_root).expanduser()).as_posix()
        command = " ".join(["empo2 train", *kept, f"run_name={name}", "resume=auto"])
        print(f"  last finished iteration {iteration}, checkpoint {path}\n  resume with: {command}", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = previous_hook
        record_interrupt(None)


def _last_checkpoint(run_dir: Path) -> tuple[Path, int] | None:
    """(newest readable checkpoint, the last iteration it completed, 0-based), None without one."""
    import torch

    from empo2.workflows.train import find_resume_checkpoint

    folder = run_dir / "checkpoints"
    path = find_resume_checkpoint(folder) if folder.is_dir() else None
    if path is None:
        return None
    return path, int(torch.load(path, map_location="cpu", weights_only=True)["epoch"])


def _cmd_config(args: argparse.Namespace) -> int:
    from empo2.config import describe

    if args.section == "launcher":  # job resources of `--launcher slurm`, outside the run config
        from empo2.workflows.slurm import describe_launcher

        print(describe_launcher())
        return 0
    print(describe(args.section))
    return 0


def run_findings(history: list[dict]) -> list[str]:
    """What a run shows about the method, from its per-iteration history: tip-free validation before and
    after training (held out and on the training instances), and what the tips add like for like: within the
    groups (one instance, iteration and set of weights) that held both rollouts with tips and tip-free ones,
    or for p = 1 against the same instance's tip-free first visit."""
    from empo2.utils import plural
    from empo2.workflows.compare import run_memory_gain

    lines = []
    for key, label in (("val/score_nomem", "tip-free validation score (held out)"),
                       ("val_train/score_nomem", "tip-free validation score (training instances)")):
        points = [(h["iteration"], h[key]) for h in history if key in h]
        if len(points) >= 2 and points[0][0] < 0:  # iteration -1: before the first update
            lines.append(f"{label}: {points[0][1]:.1f} before training -> {points[-1][1]:.1f} after")
        elif points:
            lines.append(f"{label}: {points[-1][1]:.1f} after training")
    gain = run_memory_gain(history)
    if gain is not None:
        lines.append(f"training rollouts with tips minus tip-free, like for like: {gain[0]:+.1f} (mean over "
                     f"{plural(gain[1], 'group')} of one instance and iteration holding both)")
    first = [h for h in history if "rollout/first_visit_gain" in h]
    if first:
        n = int(first[-1]["rollout/first_visit_gain_instances"])
        lines.append(f"training rollouts, later visits with tips minus the same instance's tip-free first visit: "
                     f"{first[-1]['rollout/first_visit_gain']:+.1f} ({plural(n, 'instance')})")
    missed = int(sum(h.get("rollout/episodes_mem_miss", 0.0) for h in history))
    if missed:
        lines.append(f"{plural(missed, 'rollout')} drawn with memory found no tip (counted apart, not as tip-free)")
    return lines


def gap_lines(summary: dict) -> list[str]:
    """The sampler/trainer gap of a run: 0 by construction where the engine's log-probs were the old log-probs,
    else the per-iteration `rollout/logprob_gap_*` over the run; where the update scored its samples but the engine
    kept no log-probs (`gap_unmeasured`: the HF engine under `rollout.top_p` < 1), that it was not measured;
    nothing where no update ran."""
    from empo2.utils import plural

    if summary.get("logprobs_exact"):
        return ["sampler/trainer gap: 0 by construction (the engine's log-probs, float32 like the trainer's, were "
                "the old log-probs: no scoring pass)"]
    rows = [h for h in summary.get("history", []) if "rollout/logprob_gap_mean" in h]
    if not rows:
        if summary.get("gap_unmeasured"):
            top_p = summary.get("config", {}).get("rollout", {}).get("top_p")
            return [f"sampler/trainer gap: not measured (the HF engine keeps no log-probs under rollout.top_p="
                    f"{top_p:g}: its recorder reads the whole vocabulary, not the nucleus it samples from)"]
        return []
    mean = sum(h["rollout/logprob_gap_mean"] for h in rows) / len(rows)
    worst = max(h["rollout/logprob_gap_max"] for h in rows)
    kl = sum(h["rollout/logprob_gap_kl"] for h in rows) / len(rows)
    return [f"sampler/trainer gap |log pi_old - log pi_engine| per token: mean {mean:.2e} and KL(engine || trainer) "
            f"{kl:.2e} (averaged over {plural(len(rows), 'iteration')}), max {worst:.2e}"]


def print_report(summary: dict) -> None:
    """The closing lines of a run: what it shows, the final numbers and where everything went."""
    m = summary["metrics"]
    shown = ["rollout/return", "rollout/score", "rollout/success", "val/score_nomem", "val/success_nomem",
             "val/score_mem", "val/success_mem", "memory/size", "time/total_s"]
    print("\n== empo2 run finished ==")
    for line in run_findings(summary.get("history", [])) + gap_lines(summary):
        print(f"  {line}")
    for key in shown:
        if key in m:
            print(f"  {key:<20} {m[key]:.3f}")
    phases = summary.get("phases")
    if phases:
        from empo2.lit.progress import phase_table

        print("\n".join(f"  {line}" for line in phase_table(phases)))
        print(f"  {'peak memory':<20} {phases['peak_rss_gib']:.2f} GiB (resident, this process and its children: "
              "environments, engine workers)")
    print(f"  run folder           {summary['run_dir']}")
    print(f"  summary              {summary['summary_path']}")
    print(f"  checkpoint           {summary['checkpoint']}")
    print(f"  learning curve       {summary['plot']}")
    uri = summary.get("mlflow_tracking_uri")
    if uri:
        from empo2.workflows.tracking import ui_link

        print(f"  MLflow run           {summary['mlflow_run_id']} in {uri}")
        served = uri.startswith(("http://", "https://"))
        if not served:
            print(f"  open the MLflow UI:  mlflow ui --backend-store-uri {uri}")
        link = ui_link(uri if served else "http://127.0.0.1:5000", summary["mlflow_experiment_id"],
                       summary["mlflow_run_id"])
        print(f"  {'the run in the UI' if served else 'then':<20} {link}")


def _cmd_models(args: argparse.Namespace) -> int:
    from omegaconf import OmegaConf

    from empo2.config import CONF_DIR, group_options
    from empo2.models import preset_status

    # the `model=` option that selects each preset (conf/model/<option>.yaml names it)
    option = {}
    for opt in group_options("model"):
        data = OmegaConf.load(CONF_DIR / "model" / f"{opt}.yaml")
        name = data.get("model", data).get("name")  # a preset written at the top level (@package _global_) nests it
        option.setdefault(name, opt)
    rows = [(f"model={option.get(name, name)}", status, f"{desc} [{name}]") for name, status, desc in preset_status()]
    width = max(len(r[0]) for r in rows)
    for label, status, desc in rows:
        print(f"{label:<{width}}  {desc}\n{'':<{width}}  -> {status}")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from empo2.workflows.evaluate import EVAL_OPTIONS, evaluate, int_option, parse_kv, resolve_checkpoint, run_config

    opts, overrides = parse_kv(args.rest, EVAL_OPTIONS)
    if "ckpt" not in opts:
        raise ConfigError("ckpt=... is required: a run folder or a .ckpt file")
    ckpt = resolve_checkpoint(opts["ckpt"])
    report = evaluate(run_config(ckpt, overrides), ckpt, memory=opts.get("memory", "both"),
                      split=opts.get("split", "test"), variations=int_option(opts, "variations", None),
                      rollouts=int_option(opts, "rollouts", 1), tasks=opts.get("tasks"), out=opts.get("out"))
    print(f"results: {report['json']}")
    return 0


def _cmd_adapt(args: argparse.Namespace) -> int:
    from empo2.workflows.evaluate import ADAPT_OPTIONS, adapt, int_option, parse_kv, resolve_checkpoint, run_config

    opts, overrides = parse_kv(args.rest, ADAPT_OPTIONS)
    ckpt = resolve_checkpoint(opts["ckpt"]) if "ckpt" in opts else None
    report = adapt(run_config(ckpt, overrides), ckpt, trials=int_option(opts, "trials", 3),
                   split=opts.get("split", "test"), variations=int_option(opts, "variations", None),
                   rollouts=int_option(opts, "rollouts", 1), tasks=opts.get("tasks"), out=opts.get("out"))
    print(f"results: {report['json']}; curve: {report['curve']}")
    return 0


def _cmd_grid(args: argparse.Namespace) -> int:
    from empo2.workflows.grid import grid_status, run_grid

    if args.status:
        rows = grid_status(args.file, seeds=args.seeds, overrides=args.overrides)
        for r in rows:
            job = f"SLURM job {r['job']}" + (f" {r['scheduler']}" if r["scheduler"] else "") if r["job"] else "no job"
            print(f"{r['preset']} seed {r['seed']}: {r['status']} ({job}; {r['run_dir']})")
        return 0
    records = run_grid(args.file, seeds=args.seeds, workers=args.workers, overrides=args.overrides,
                       launcher=args.launcher)
    failed = [r for r in records if r["status"] == "failed"]
    for r in failed:
        print(f"failed: {r['preset']} seed {r['seed']} (log {r['log']})")
    return 1 if failed else 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    from empo2.workflows.sweep import run_sweep

    result = run_sweep(args.file, workers=args.workers, overrides=args.overrides, n_trials=args.n_trials,
                       timeout=args.timeout, storage=args.storage, launcher=args.launcher)
    return 0 if result["best"] else 1


def _cmd_compare(args: argparse.Namespace) -> int:
    from empo2.workflows.compare import compare

    uri = args.tracking_uri or f"sqlite:///{Path(args.run_root).expanduser().resolve() / 'mlflow.db'}"
    out = args.out or Path(args.run_root) / "compare" / args.experiment.replace("/", "_")
    metrics = [m.strip() for m in args.metrics.split(",") if m.strip()] if args.metrics else None
    result = compare(args.experiment, uri, out, group_by=args.group_by, metrics=metrics, storage=args.storage,
                     x=args.x, baseline=args.baseline)
    print(Path(result["table"]).read_text(), end="")
    if result["paired"]:
        print("\n" + (Path(result["out"]) / "paired.md").read_text(), end="")
    instances = ", instances.csv" if (Path(result["out"]) / "instances.csv").is_file() else ""
    print(f"written to {result['out']}: compare.md, compare.csv, runs.csv{instances}"
          + (", paired.md, paired.csv" if result["paired"] else "") + f", {len(result['curves'])} curves"
          + (f", {len(result['sweep'])} sweep files" if result["sweep"] else ""))
    return 0


def _add_run_options(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("file", help=f"the {what} YAML file")
    p.add_argument("overrides", nargs="*", help="config overrides applied to every run, e.g. model=tiny")
    p.add_argument("--workers", type=int, default=1, help="worker processes running at once (default 1); with "
                                                          "--launcher slurm, a sweep's worker jobs")
    p.add_argument("--launcher", choices=("local", "slurm"), default="local",
                   help="local: worker processes on this machine; slurm: one SLURM job per grid run or sweep "
                        "worker, resources from launcher.KEY=VALUE (`empo2 config launcher`, docs/cluster.md)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="empo2",
        description="EMPO²: memory-augmented exploration with hybrid on/off-policy RL for LLM agents.",
    )
    parser.add_argument("--verbose", action="store_true", help="keep the libraries' own INFO output")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == "train":
            p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. algo.p=0.4 model=tiny (groups and "
                                                        "fields: `empo2 config`)")
            p.add_argument("--cfg", action="store_true", help="print the resolved config and exit")
            p.set_defaults(func=_cmd_train)
        elif name == "config":
            p.add_argument("section", nargs="?", help="a group (algo, env, ...), `train` for the root fields or "
                                                       "`experiment` for the presets")
            p.set_defaults(func=_cmd_config)
        elif name == "models":
            p.set_defaults(func=_cmd_models)
        elif name in ("eval", "adapt"):
            p.add_argument("rest", nargs=argparse.REMAINDER, help="key=value options and config overrides")
            p.set_defaults(func=_cmd_eval if name == "eval" else _cmd_adapt)
        elif name == "grid":
            _add_run_options(p, "grid")
            p.add_argument("--seeds", help="a count (3: seeds 0,1,2) or a list (0,5,7); default: the file's seeds")
            p.add_argument("--status", action="store_true", help="print each run's state (finished, queued, running, "
                                                                 "failed, not started) from its folder and SLURM")
            p.set_defaults(func=_cmd_grid)
        elif name == "sweep":
            _add_run_options(p, "sweep")
            p.add_argument("--n-trials", type=int, help="the study's total number of trials (default: the file's)")
            p.add_argument("--timeout", type=float, help="seconds after which no new trial starts")
            p.add_argument("--storage", help="Optuna storage URL (default: the file's, else sqlite in the run root); "
                                             "postgresql://USER@HOST/DB shares one study between workers on many "
                                             "nodes, started in any order (docs/team_scale.md)")
            p.set_defaults(func=_cmd_sweep)
        else:
            p.add_argument("--experiment", required=True, help="MLflow experiment name")
            p.add_argument("--group-by", help="tag or parameter that groups runs (default: trial for a sweep's "
                                              "runs, else preset)")
            p.add_argument("--metrics", help="comma-separated metrics (default: validation and rollout scores)")
            p.add_argument("--x", help="metric to plot the curves against instead of the iteration, "
                                       "e.g. train/env_steps")
            p.add_argument("--baseline", help="a group (e.g. grpo_minisci_tips) to subtract from every other one, "
                                              "paired by seed: paired.md and paired.csv")
            p.add_argument("--run-root", default="outputs", help="where the runs and mlflow.db live")
            p.add_argument("--tracking-uri", help="MLflow tracking URI (default: sqlite in the run root)")
            p.add_argument("--out", help="output folder (default <run-root>/compare/<experiment>)")
            p.add_argument("--storage", help="Optuna storage URL of a sweep, if not the one recorded")
            p.set_defaults(func=_cmd_compare)
    return parser




def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # overrides may follow options (`grid FILE --seeds 3 model=tiny`); argparse leaves those over
    if extra and (not hasattr(args, "overrides") or any(x.startswith("-") or "=" not in x for x in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    if not args.verbose:
        quiet_libraries()
    from empo2.utils.errors import NonFiniteLossError

    try:
        return args.func(args)
    except ConfigError as e:
        print(f"empo2 {args.command}: error: {e}", file=sys.stderr)
        return 2
    except NonFiniteLossError as e:  # a diverged run: one line, the checkpoint it saved is named in it
        print(f"empo2 {args.command}: error: {e}", file=sys.stderr)
        return 1
    finally:
        thaw_startup_heap()


if __name__ == "__main__":
    sys.exit(main())

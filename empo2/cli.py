"""The `empo2` command. Each subcommand parses its own arguments and hands a validated config to a
plain Python function (`train(cfg)`, ...), so everything the CLI does is also a library call.

User mistakes (a bad config value, a missing model) print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from empo2.config import ConfigError

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded at run time
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SUBCOMMANDS = {
    "train": "train a policy: `empo2 train [hydra overrides, e.g. algo.p=0.4 env=scienceworld]`",
    "eval": "evaluate a checkpoint with and without memory (not available in this version)",
    "adapt": "memory-only adaptation to new tasks, no parameter updates (not available in this version)",
    "grid": "run an ablation grid of presets x seeds (not available in this version)",
    "sweep": "Optuna sweep of p, q, delta, beta (not available in this version)",
    "compare": "MLflow comparison tables and plots (not available in this version)",
    "models": "list the policy presets and whether each is available on this machine",
}


def _cmd_train(args: argparse.Namespace) -> int:
    from empo2.config import load_config
    from empo2.train import train

    cfg = load_config(args.overrides)
    summary = train(cfg)
    print_report(summary)
    return 0


def print_report(summary: dict) -> None:
    """The closing lines of a run: final numbers and where everything went."""
    m = summary["metrics"]
    shown = ["rollout/return", "rollout/score", "rollout/success", "val/score_nomem", "val/success_nomem",
             "val/score_mem", "val/success_mem", "memory/size", "time/total_s"]
    print("\n== empo2 run finished ==")
    for key in shown:
        if key in m:
            print(f"  {key:<20} {m[key]:.3f}")
    print(f"  run folder           {summary['run_dir']}")
    print(f"  summary              {summary['summary_path']}")
    print(f"  checkpoint           {summary['checkpoint']}")
    print(f"  learning curve       {summary['plot']}")
    if summary.get("mlflow_tracking_uri"):
        print(f"  MLflow run           {summary['mlflow_run_id']} in {summary['mlflow_tracking_uri']}")
        print(f"  open the MLflow UI:  mlflow ui --backend-store-uri {summary['mlflow_tracking_uri']}")


def _cmd_models(args: argparse.Namespace) -> int:
    from empo2.models import preset_status

    rows = preset_status()
    width = max(len(r[0]) for r in rows)
    for name, status, desc in rows:
        print(f"{name:<{width}}  {desc}\n{'':<{width}}  -> {status}")
    return 0


def _cmd_unavailable(args: argparse.Namespace) -> int:
    raise ConfigError(f"`empo2 {args.command}` is not available in this version")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="empo2",
        description="EMPO²: memory-augmented exploration with hybrid on/off-policy RL for LLM agents.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == "train":
            p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. algo.p=0.4 model=tiny")
            p.set_defaults(func=_cmd_train)
        elif name == "models":
            p.set_defaults(func=_cmd_models)
        else:
            p.add_argument("rest", nargs=argparse.REMAINDER)
            p.set_defaults(func=_cmd_unavailable)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"empo2 {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

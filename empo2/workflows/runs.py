"""Where a run's records go, shared by training and the workflows that start or record runs (evaluate, grid,
sweep): the MLflow tracking URI, the tags every run carries (with the code's git commit), and the check that the
tracking store answers before any work starts."""

from __future__ import annotations

from pathlib import Path

from empo2.config import ConfigError, TrainConfig


def tracking_uri(cfg: TrainConfig) -> str:
    """The run's MLflow tracking URI: `logger.tracking_uri`, else a sqlite file under the run root."""
    return cfg.logger.tracking_uri or f"sqlite:///{Path(cfg.run_root).expanduser().resolve() / 'mlflow.db'}"


def check_tracking(cfg: TrainConfig) -> None:
    """Fail before any work when the MLflow tracking store cannot be reached (a server that is down, a
    sqlite file that cannot be opened), instead of at the first metric, minutes or hours in."""
    if cfg.logger.name == "none":
        return
    import mlflow

    from empo2.workflows.tracking import first_line, quick_requests

    uri = tracking_uri(cfg)
    try:
        with quick_requests():
            mlflow.MlflowClient(uri).search_experiments(max_results=1)
    except Exception as e:
        raise ConfigError(f"logger.tracking_uri={uri!r} cannot be reached: {first_line(e, 200)} "
                          f"(start the tracking server, fix the URI, or use logger=none)") from None


def source_version() -> dict[str, str]:
    """`git_commit` (with `-dirty` when the checkout has uncommitted changes) of the code that runs, when it
    runs from a git checkout; nothing otherwise (an installed wheel)."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return {}
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return {"git_commit": commit + ("-dirty" if dirty else "")} if commit else {}


def run_tags(cfg: TrainConfig, kind: str = "train") -> dict[str, str]:
    """The MLflow tags of a run made with this config: what it is (`kind`: train, eval, adapt), algo, env,
    model, seed, preset, the code's git commit, then `logger.tags` (grid, sweep, trial, the user's own)."""
    tags = {"kind": kind, "algo": cfg.algo.name, "env": cfg.env.name, "model": cfg.model.name,
            "seed": str(cfg.seed), **source_version()}
    if cfg.experiment:
        tags["preset"] = cfg.experiment
    tags.update({str(k): str(v) for k, v in cfg.logger.tags.items()})
    return tags

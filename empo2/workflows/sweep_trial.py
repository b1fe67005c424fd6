"""One sweep trial: `python -m empo2.workflows.sweep_trial <study> <trial number> <overrides...>`.

Started by the `empo2 sweep` driver, never by hand. The process opens the study's storage (its URL
arrives in an environment variable, so no password lands in a command line or log), trains with a
callback that reports the objective after every validation and stops the run once the median pruner
says so, then tells the study the outcome. While it trains it records the trial's heartbeat (as its
driver does), so the trial is taken for lost only when both are gone. Under DDP/FSDP, Lightning
starts the other ranks by re-running this same command; only rank 0 reports and tells.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys

from empo2.utils import pause_gc_for_startup, thaw_startup_heap

if __name__ == "__main__":  # a trial's own process: the collector pauses for its start-up (`empo2.utils`)
    pause_gc_for_startup()

import lightning as L  # noqa: E402

from empo2.config import ConfigError, current_metric, load_config  # noqa: E402
from empo2.workflows.launch import log_run_files  # noqa: E402
from empo2.workflows.sweep import STORAGE_ENV  # noqa: E402
from empo2.workflows.sweep_spec import make_pruner  # noqa: E402
from empo2.workflows.sweep_storage import Heartbeat, open_storage  # noqa: E402


class PruneOnValidation(L.Callback):
    """Reports the objective to the Optuna trial after every validation and stops the run when the
    pruner says so. Rank 0 reports and decides; the decision is broadcast so all ranks stop together."""

    def __init__(self, trial, metric: str) -> None:
        self.trial, self.metric = trial, metric
        self.pruned = False
        self.is_global_zero = True
        self._seen = 0  # history entries already looked at

    def setup(self, trainer: L.Trainer, pl_module, stage: str) -> None:
        self.is_global_zero = trainer.is_global_zero

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module) -> None:
        from empo2.lit.callbacks import RolloutCallback

        # RolloutCallback comes first in the trainer's list, so this epoch's validation is already in
        history = next(cb.history for cb in trainer.callbacks if isinstance(cb, RolloutCallback))
        validations = [h for h in history[self._seen:] if any(k.startswith("val/") for k in h)]
        self._seen = len(history)
        if not validations:
            return
        prune = False
        if trainer.is_global_zero:
            value = next((h[self.metric] for h in reversed(history) if self.metric in h), None)
            if value is not None and math.isfinite(value):
                self.trial.report(float(value), step=int(validations[-1]["iteration"]))
                prune = self.trial.should_prune()
        if trainer.strategy.broadcast(prune, src=0):
            self.pruned = True
            trainer.should_stop = True


def run_trial(study_name: str, number: int, overrides: list[str]) -> int:
    """Train one trial with pruning, then tell the study its value (or that it was pruned or failed)."""
    import optuna
    from mlflow.entities import Param
    from mlflow.tracking import MlflowClient

    from empo2.workflows.train import train

    storage = open_storage(os.environ[STORAGE_ENV])
    study = optuna.load_study(study_name=study_name, storage=storage)
    attrs = study.user_attrs
    study.pruner = make_pruner(attrs["pruner"])
    trial_id = storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(study_name), number)
    trial = optuna.trial.Trial(study, trial_id)
    cfg = load_config(overrides)
    cfg.logger.tags.update({"sweep": study_name, "trial": str(number)})
    if attrs.get("mlflow_parent_run_id"):
        cfg.logger.tags["mlflow.parentRunId"] = attrs["mlflow_parent_run_id"]  # how MLflow nests a run
    metric = current_metric(attrs["metric"])  # a study created before the metric's rename names it the old way
    pruning = PruneOnValidation(trial, metric)
    if os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0":
        beating = Heartbeat(storage, trial_id, (attrs.get("heartbeat") or {}).get("interval", 60))
    else:  # a DDP rank re-running this command: rank 0 beats for the trial
        beating = contextlib.nullcontext()
    with beating:
        summary = train(cfg, callbacks=[pruning])
    if not pruning.is_global_zero:
        return 0
    value = summary["metrics"].get(metric)
    State = optuna.trial.TrialState
    if pruning.pruned:
        state = State.PRUNED
        study.tell(number, state=state)
    elif value is None or not math.isfinite(value):
        state = State.FAIL
        study.tell(number, state=state)
        print(f"trial {number}: metric {metric} is {value}; logged: {', '.join(sorted(summary['metrics']))}")
    else:
        state = State.COMPLETE
        study.tell(number, float(value))
    if summary["mlflow_run_id"]:
        client = MlflowClient(summary["mlflow_tracking_uri"])
        client.log_batch(summary["mlflow_run_id"], params=[Param(k, str(v)) for k, v in trial.params.items()])
        client.set_tag(summary["mlflow_run_id"], "optuna.state", state.name)
        log_run_files(summary)  # after the trial's own params: the config's copies of them are skipped
    return 1 if state == State.FAIL else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or not argv[1].isdigit() or STORAGE_ENV not in os.environ:
        print("usage: started by `empo2 sweep`: python -m empo2.workflows.sweep_trial STUDY NUMBER [overrides...] "
              f"with {STORAGE_ENV} set", file=sys.stderr)
        return 2
    try:
        return run_trial(argv[0], int(argv[1]), argv[2:])
    except ConfigError as e:
        print(f"empo2 sweep trial: error: {e}", file=sys.stderr)
        return 2
    finally:
        thaw_startup_heap()


if __name__ == "__main__":
    sys.exit(main())

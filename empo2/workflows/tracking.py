"""MLflow tracking that survives its server: a run keeps training through an outage and loses no metric.

A shared tracking server can restart, be redeployed or drop off the network while a run trains for hours.
Lightning's `MLFlowLogger` calls the server synchronously with MLflow's default of 7 retries, back-off and a
120 s timeout per request, so an outage stalls every logging call for minutes and then raises out of
`fit`. `ResilientMLFlowLogger` instead queues every batch (metrics with their original step and timestamp,
params), sends the queue in order with one quick attempt, and on failure says so once and keeps
training; it tries again at most every `retry_s` seconds and says once when the server is back. Whatever
is still undelivered is spooled atomically to `mlflow_pending.json` in the run folder after every failed
attempt (so a run killed during the outage loses nothing either) and delivered by the next
`empo2 train ... resume=auto` of that run.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only

from empo2.utils import atomic_write_json

SPOOL_NAME = "mlflow_pending.json"
# MLflow 3's UI shows an experiment either as GenAI work (traces, evaluations) or as model training (runs,
# params, metric charts). Its UIs up to the GenAI/Model-training switch read the view from this experiment tag
# (MLflow's own key and value); the switch reads it from the link instead, hence MLFLOW_UI_VIEW.
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
MLFLOW_UI_VIEW = "workflowType=machine_learning"


@contextlib.contextmanager
def quick_requests(timeout: float = 10.0):
    """MLflow HTTP calls inside make one attempt with a short timeout (user settings of the two variables
    win): a missing server then costs seconds, not MLflow's default minutes of retries."""
    quick = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": str(int(timeout))}
    unset = [k for k in quick if k not in os.environ]
    os.environ.update({k: quick[k] for k in unset})
    try:
        yield
    finally:
        for k in unset:
            os.environ.pop(k, None)


def first_line(e: BaseException, limit: int = 160) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:limit]


def ui_link(base: str, experiment: str, run_id: str | None = None) -> str:
    """The MLflow UI page of an experiment (or one of its runs) under `base` (http://HOST:PORT), in the
    model-training view."""
    page = f"{base.rstrip('/')}/#/experiments/{experiment}" + (f"/runs/{run_id}" if run_id else "")
    return f"{page}?{MLFLOW_UI_VIEW}"


def artifact_location(uri: str) -> str | None:
    """Where a new experiment of a local sqlite store keeps its runs' files: `mlartifacts/` beside the
    database, so a run root holds everything of its runs (MLflow's default, `./mlruns`, is relative to the
    working directory of whichever process created the experiment). Other stores choose their own: None."""
    if not uri.startswith("sqlite:///"):
        return None
    return (Path(uri.removeprefix("sqlite:///")).resolve().parent / "mlartifacts").as_uri()


def experiment_id(client, name: str) -> str:
    """The id of MLflow experiment `name`, created when missing, marked as a model-training experiment
    (`EXPERIMENT_KIND`) so the UI opens it on its runs. An experiment without the mark gets it; a kind set
    by hand is left alone."""
    from mlflow.exceptions import MlflowException

    key, value = EXPERIMENT_KIND
    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            return client.create_experiment(name, artifact_location=artifact_location(client.tracking_uri),
                                            tags={key: value})
        except MlflowException:  # another process (a grid worker, a sweep driver) created it just before
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise
    if key not in exp.tags:
        client.set_experiment_tag(exp.experiment_id, key, value)
    return exp.experiment_id


def flat_config(config: dict, prefix: str = ""):
    """(dotted key, value) of every leaf of a nested config: `algo.p`, `trainer.lr`, ..."""
    for key, value in config.items():
        if isinstance(value, dict) and value:
            yield from flat_config(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def upload(client, run_id: str, config: dict | None = None, metrics: list[tuple[str, float, int]] = (),
           files: list = ()) -> None:
    """Onto an MLflow run: the config's leaves as params (keys the run already has are left alone), metrics
    as (key, value, step), and files as artifacts, each call within MLflow's batch limits."""
    import json

    from mlflow.entities import Metric, Param

    known = client.get_run(run_id).data.params
    params = [Param(k, (json.dumps(v) if isinstance(v, (list, dict)) else str(v))[:500])
              for k, v in flat_config(config or {}) if k not in known]
    for i in range(0, len(params), 100):  # MLflow takes at most 100 params per call
        client.log_batch(run_id, params=params[i:i + 100])
    stamp = int(time.time() * 1000)
    rows = [Metric(key=k, value=float(v), timestamp=stamp, step=int(s)) for k, v, s in metrics]
    for i in range(0, len(rows), 1000):  # and at most 1000 metrics
        client.log_batch(run_id, metrics=rows[i:i + 1000])
    for path in files:
        if path and Path(path).is_file():
            client.log_artifact(run_id, str(path))


class ResilientMLFlowLogger(MLFlowLogger):
    """`MLFlowLogger` whose calls never block training for long nor raise out of it (see the module doc).

    `spool` is the file undelivered batches go to at the end of the run (and are read back from when a
    resumed run opens the same file); `retry_s` is the shortest wait between attempts while the server is
    away (short: each failed attempt costs up to `timeout` seconds of training time)."""

    def __init__(self, *args, spool: Path, retry_s: float = 30.0, timeout: float = 10.0, log=print, **kwargs):
        super().__init__(*args, **kwargs)
        self.spool, self.retry_s, self.timeout, self._say = Path(spool), retry_s, timeout, log
        self._queue: list[dict] = []  # {"metrics": [[key, value, timestamp_ms, step]], "params": [[k, v]]}
        self._down_since: float | None = None
        self._last_try = 0.0
        if self.spool.is_file():  # a previous attempt of this run ended with the server away
            import json

            # the earlier attempt's own end of run is dropped: this attempt ends the run again
            self._queue = [b for b in json.loads(self.spool.read_text()) if "terminate" not in b]
            self._say(f"mlflow: {len(self._queue)} logging batches of an earlier attempt were not delivered; "
                      f"sending them first")

    # ------------------------------------------------------------------------------------------ API
    @property
    @rank_zero_experiment
    def experiment(self):
        # a new run's experiment is ours to create (marked as model training), not Lightning's
        if not self._initialized and self._run_id is None and self._experiment_id is None:
            self._experiment_id = experiment_id(self._mlflow_client, self._experiment_name)
        return super().experiment

    @rank_zero_only
    def log_metrics(self, metrics, step: int | None = None) -> None:
        metrics = dict(metrics)
        if "epoch" in metrics:  # Lightning's own epoch-level logs: filed under the iteration (= epoch), not
            step = int(metrics.pop("epoch"))  # the optimiser step, so they share the rollout metrics' axis
        stamp = int(time.time() * 1000)
        rows = [[k, float(v), stamp, int(step or 0)] for k, v in self._clean(metrics).items()]
        if rows:
            self._queue.append({"metrics": rows})
        self.flush()

    @rank_zero_only
    def log_hyperparams(self, params) -> None:
        from lightning.fabric.utilities.logger import _convert_params, _flatten_dict

        flat = _flatten_dict(_convert_params(params))
        items = [[k, str(v)[:250]] for k, v in flat.items()]
        self._queue += [{"params": items[i:i + 100]} for i in range(0, len(items), 100)]  # MLflow's batch limit
        self.flush()

    @rank_zero_only
    def finalize(self, status: str = "success") -> None:
        if not self._initialized:
            return
        mlflow_status = {"success": "FINISHED", "finished": "FINISHED", "failed": "FAILED"}.get(status, status)
        self._queue.append({"terminate": mlflow_status})
        self.flush(force=True)
        self.save_pending()

    @property
    def pending(self) -> int:
        """Batches not yet on the server."""
        return len(self._queue)

    def save_pending(self) -> None:
        """Write what is still undelivered to the spool (or remove the spool once all is delivered)."""
        if self._queue:
            atomic_write_json(self.spool, self._queue)
            self._say(f"mlflow: {len(self._queue)} logging batches could not be delivered to "
                      f"{self._tracking_uri}; kept in {self.spool}, sent by the next `resume=auto` of this run")
        else:
            self.spool.unlink(missing_ok=True)

    # -------------------------------------------------------------------------------------- delivery
    def flush(self, force: bool = False) -> bool:
        """Send the queue in order; False (and the rest kept) at the first failure."""
        if not self._queue:
            return True
        now = time.monotonic()
        if self._down_since is not None and not force and now - self._last_try < self.retry_s:
            return False
        self._last_try = now
        sent = 0
        try:
            with quick_requests(self.timeout):
                for batch in self._queue:
                    self._send(batch)
                    sent += 1
        except Exception as e:
            del self._queue[:sent]
            atomic_write_json(self.spool, self._queue)  # a run killed during the outage loses nothing either
            if self._down_since is None:
                self._down_since = now
                self._say(f"mlflow: tracking server {self._tracking_uri} unreachable ({first_line(e)}); training "
                          f"goes on, metrics are kept and retried every {self.retry_s:.0f} s")
            return False
        self._queue.clear()
        if self._down_since is not None:
            self._say(f"mlflow: tracking server {self._tracking_uri} is back after {now - self._down_since:.0f} s; "
                      f"every kept metric delivered")
            self._down_since = None
        self.spool.unlink(missing_ok=True)
        return True

    def _send(self, batch: dict) -> None:
        from mlflow.entities import Metric, Param

        if "terminate" in batch:
            self.experiment.set_terminated(self.run_id, batch["terminate"])
            return
        metrics = [Metric(key=k, value=v, timestamp=t, step=s) for k, v, t, s in batch.get("metrics", [])]
        params = [Param(key=k, value=v) for k, v in batch.get("params", [])]
        self.experiment.log_batch(run_id=self.run_id, metrics=metrics, params=params, **self._log_batch_kwargs)

    def _clean(self, metrics) -> dict:
        """Lightning's key rules: the prefix, string values dropped, characters MLflow refuses removed."""
        import re

        from lightning.fabric.utilities.logger import _add_prefix

        out = {}
        for k, v in _add_prefix(metrics, self._prefix, self.LOGGER_JOIN_CHAR).items():
            if not isinstance(v, str):
                out[re.sub("[^a-zA-Z0-9_/. -]+", "", k)] = v
        return out

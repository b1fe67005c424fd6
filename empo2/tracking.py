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
from lightning.pytorch.utilities import rank_zero_only

from empo2.utils import atomic_write_json

SPOOL_NAME = "mlflow_pending.json"


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

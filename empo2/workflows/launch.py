"""Local worker processes for grid runs and sweep trials.

Every run is a fresh `python -m ...` process, never a fork of the driver: Lightning's DDP/FSDP
launcher starts the other ranks by re-running the process's own command line, so a run must be a
command that stands on its own. Each worker slot gets its own GPUs (`CUDA_VISIBLE_DEVICES`) and its
share of CPU threads; a run's output goes to its log file and the driver prints one line per run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from empo2.config import ConfigError, TrainConfig, load_config


def hydra_quote(value: object) -> str:
    """A value as a quoted Hydra override string (safe for any text)."""
    text = str(value).replace("\\", "\\\\").replace("'", "\\'")
    return f"'{text}'"


def load_run_config(args: list[str], where: str, what: str) -> TrainConfig:
    """The config of a run the driver will launch (`what`: "grid runs", "sweep trials"), checked before any
    starts: an error names `where`; such runs are compared in MLflow, so another logger is refused."""
    try:
        cfg = load_config(args)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    if cfg.logger.name != "mlflow":
        raise ConfigError(f"{where}: {what} are tracked in MLflow; drop logger={cfg.logger.name}")
    return cfg


def _visible_gpus() -> list[str]:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d for d in env.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def slot_gpus(workers: int) -> list[str | None]:
    """GPUs per worker slot: an even split when there are enough, else one shared GPU each
    (round robin); None where the machine has none (the variable is then left alone)."""
    gpus = _visible_gpus()
    if not gpus:
        return [None] * workers
    if len(gpus) >= workers:
        k = len(gpus) // workers
        return [",".join(gpus[i * k:(i + 1) * k]) for i in range(workers)]
    return [gpus[i % len(gpus)] for i in range(workers)]


@dataclass
class _Job:
    key: object
    proc: subprocess.Popen
    slot: int
    log: Path


class WorkerPool:
    """At most `workers` child processes at a time. Use as a context manager: leaving the block
    (normally, on an error or on Ctrl-C) terminates whatever still runs, ranks included."""

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ConfigError(f"--workers={workers} is out of range: expected >= 1")
        self.workers = workers
        self.gpus = slot_gpus(workers)
        self.threads = max(1, (os.cpu_count() or 1) // workers)
        self.jobs: list[_Job] = []

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        for job in self.jobs:
            self._kill(job)
        self.jobs.clear()

    @property
    def free(self) -> int:
        return self.workers - len(self.jobs)

    def start(self, key: object, module: str, args: list[str], log: Path, env: dict | None = None) -> None:
        """Run `python -m module args...` in a free slot, its output appended to `log`; `env` adds
        variables (kept out of the command line, which is written to the log)."""
        slot = min(set(range(self.workers)) - {j.slot for j in self.jobs})
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "MLFLOW_DISABLE_TELEMETRY": "true", **(env or {})}
        env.pop("EMPO2_RUN_NAME", None)  # set by a run for its own ranks; must not leak into the next run
        # inside a SLURM job (a sweep worker job, an allocation) the run's ranks are its own launcher's to start:
        # without the job's task count Lightning does not take the job's one task for the run's world
        env.pop("SLURM_NTASKS", None)
        env.setdefault("OMP_NUM_THREADS", str(self.threads))  # N workers share the cores instead of each taking all
        if self.gpus[slot] is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.gpus[slot]
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            out.write(f"$ {sys.executable} -m {module} {' '.join(args)}\n".encode())
            out.flush()
            # own session: a kill reaches the run's DDP ranks too
            proc = subprocess.Popen([sys.executable, "-m", module, *args], stdout=out, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True)
        self.jobs.append(_Job(key, proc, slot, log))

    def wait(self, timeout: float | None = None) -> tuple[object, int, Path] | None:
        """Block until one run ends; returns its key, exit status and log (None after `timeout` seconds
        with every run still going)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            for job in self.jobs:
                rc = job.proc.poll()
                if rc is not None:
                    self.jobs.remove(job)
                    return job.key, rc, job.log
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(0.2)

    @staticmethod
    def _kill(job: _Job) -> None:
        if job.proc.poll() is not None:
            return
        try:
            os.killpg(job.proc.pid, signal.SIGTERM)
            job.proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(job.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def last_line(log: Path) -> str:
    """The last non-empty line of a log (usually the error that ended a failed run)."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:200] if lines else ""


def log_run_files(summary: dict) -> None:
    """Onto a finished run's MLflow run: its resolved config as params (`algo.p`, `trainer.lr`, ...; keys
    already logged are left alone) and its learning curve, config.yaml and summary.json as artifacts, so a shared
    tracking server holds them and not only the node that ran it. Best effort: a tracking server that
    is away is said once, and everything stays in the run folder."""
    run_id, uri = summary.get("mlflow_run_id"), summary.get("mlflow_tracking_uri")
    if not run_id or not uri:
        return
    from mlflow.tracking import MlflowClient

    from empo2.workflows.tracking import first_line, quick_requests, upload

    try:
        with quick_requests():
            upload(MlflowClient(uri), run_id, config=summary.get("config"),
                   files=[summary.get("plot"), summary.get("config_file"), summary.get("summary_path")])
    except Exception as e:
        print(f"could not store the config and files of MLflow run {run_id} ({first_line(e)}); they stay in "
              f"{summary.get('run_dir')}")

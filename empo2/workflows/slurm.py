"""`--launcher slurm`: grid runs and sweep workers as SLURM jobs, submitted through submitit.

Each job runs the same `python -m empo2.cli ...` command a local worker would, from the submitting
folder with the submitting environment (a shared file system and Python installation, as on any
cluster). A job asks for `nodes` x `tasks_per_node` tasks (one per GPU by default); srun starts the command
once per task, and Lightning's SLURM cluster environment reads each process's rank from SLURM_PROCID, so a
multi-GPU, multi-process or multi-node run needs no torchrun. Preemption and the time limit send SIGUSR2
shortly before the kill: submitit then requeues the job (`--requeue`), and the same command with
`resume=auto` continues from the run's last checkpoint. The job resources come from `launcher.KEY=VALUE`
arguments, checked here and against the cluster (`sinfo`) before anything is submitted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import submitit
from submitit.core.utils import FailedJobError

from empo2.config import ConfigError, _check_field, field_lines, opt
from empo2.workflows.launch import last_line

PREFIX = "launcher."
POLL_S = 2.0  # seconds between squeue queries while jobs run
# squeue states after which a job will not run again. Not PREEMPTED: with --requeue a preempted job passes
# through it on its way back to PENDING (one preempted for good is forgotten after MinJobAge, and so ends too)
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "SPECIAL_EXIT", "REVOKED"}


@dataclass
class SlurmConfig:
    partition: str | None = opt(None, "Partition (queue) of every job; null uses the cluster's default. A short "
                                "debug partition starts jobs sooner but caps `time`.", nullable=True)
    nodes: int = opt(1, "Nodes per job. More than 1 only for a multi-node DDP/FSDP run (sets trainer.num_nodes): "
                     "more throughput per run, but the job waits until that many nodes are free at once.", ge=1)
    gpus_per_node: int = opt(0, "GPUs per node (sbatch --gpus-per-node), one task (Lightning rank) per GPU "
                             "unless `tasks_per_node` says otherwise. 0: a CPU job. More GPUs shorten a run but "
                             "queue longer and multiply what an idle rollout phase wastes.", ge=0)
    tasks_per_node: int | None = opt(None, "Tasks per node (sbatch --ntasks-per-node), each one Lightning rank "
                                     "started by srun; sets trainer.devices. null: one per GPU (`gpus_per_node`), "
                                     "or one on a CPU job. With GPUs it must equal `gpus_per_node` (a rank takes one "
                                     "GPU); on CPUs (trainer.accelerator=cpu) it gives a data-parallel run several "
                                     "ranks per node, each with its own engine and `cpus_per_task` cores.",
                                     ge=1, nullable=True)
    cpus_per_task: int = opt(4, "CPU cores per task (also its OMP_NUM_THREADS): environments, tokenization and "
                             "data loading run here; cores a run does not use still count against the allocation.",
                             ge=1)
    mem_gb: int | None = opt(None, "Memory per node in GiB; null takes the partition's default. Too little kills "
                             "the job (OUT_OF_MEMORY), too much waits for a bigger node.", gt=0, nullable=True)
    time: int = opt(240, "Wall-clock limit per job in minutes. Short limits start sooner (backfill); a run that "
                    "reaches it is requeued and resumes from its last checkpoint, losing at most one checkpoint "
                    "interval of work per requeue.", gt=0)
    account: str | None = opt(None, "Account charged for the jobs (sbatch --account); null: the user's default.",
                              nullable=True)
    max_requeues: int = opt(3, "Times a job that reaches its time limit is requeued before it is left failed "
                            "(preemptions do not count). Higher finishes long runs under short limits; a run that "
                            "never checkpoints would only repeat itself.", ge=0)
    extra: list = opt([], "Further `#SBATCH` options, each `--key=value` or `--flag` (e.g. `--qos=high`, "
                      "`--constraint=a100`): cluster policies the fields above do not cover.")


def describe_launcher() -> str:
    """`empo2 config launcher`: every job resource field with its default, range and trade-off."""
    return "\n".join(["launcher (`--launcher slurm` job resources, set with launcher.KEY=VALUE):",
                      *field_lines(SlurmConfig(), PREFIX)])


def split_overrides(overrides: list[str] | tuple) -> tuple[list[str], list[str]]:
    """(`launcher.*` arguments, the rest): the former configure jobs, the latter every run."""
    ours = [o for o in overrides if o.startswith(PREFIX)]
    return ours, [o for o in overrides if not o.startswith(PREFIX)]


def load_slurm_config(overrides: list[str] | tuple = ()) -> SlurmConfig:
    """The job resources from `launcher.KEY=VALUE` arguments; a bad key or value raises `ConfigError` naming it."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    schema = OmegaConf.structured(SlurmConfig)
    OmegaConf.set_struct(schema, True)
    names = [f.name for f in dataclasses.fields(SlurmConfig)]
    for item in overrides:
        key, eq, _ = item.partition("=")
        name = key[len(PREFIX):]
        if not eq or name not in names:
            raise ConfigError(f"{key}: unknown key (the fields: {', '.join(PREFIX + n for n in names)}; "
                              "`empo2 config launcher` documents them)")
    try:
        cfg: SlurmConfig = OmegaConf.to_object(OmegaConf.merge(  # type: ignore[assignment]
            schema, OmegaConf.from_dotlist([o[len(PREFIX):] for o in overrides])))
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "launcher"
        raise ConfigError(f"{PREFIX}{key}: {str(e).splitlines()[0]}") from None
    for f in dataclasses.fields(cfg):
        _check_field(PREFIX + f.name, f, getattr(cfg, f.name))
    if cfg.gpus_per_node and cfg.tasks_per_node not in (None, cfg.gpus_per_node):
        raise ConfigError(f"{PREFIX}tasks_per_node={cfg.tasks_per_node} does not match {PREFIX}gpus_per_node="
                          f"{cfg.gpus_per_node}: each task (rank) takes one GPU")
    for line in cfg.extra:
        text = str(line).removeprefix("#SBATCH").strip()
        if not text.startswith("--") or "\n" in text or len(text) < 3:
            raise ConfigError(f"{PREFIX}extra={line!r} is not allowed: expected `--key=value` or `--flag`")
    return cfg


def tasks_per_node(cfg: SlurmConfig) -> int:
    """The ranks a job starts on each node: `tasks_per_node`, else one per GPU, else one."""
    return cfg.tasks_per_node or max(1, cfg.gpus_per_node)


def run_overrides(cfg: SlurmConfig) -> list[str]:
    """What a run must know of its job: the number of ranks per node and of nodes, when there is more than
    one rank (Lightning checks them against the job's tasks). A one-task job changes nothing, so its runs
    keep the config a local run has."""
    tasks = tasks_per_node(cfg)
    if tasks == 1 and cfg.nodes == 1:
        return []
    return [f"trainer.devices={tasks}", f"trainer.num_nodes={cfg.nodes}"]


def _sbatch_options(cfg: SlurmConfig) -> dict:
    extra = {}
    for line in cfg.extra:
        key, eq, value = str(line).removeprefix("#SBATCH").strip()[2:].partition("=")
        extra[key.replace("-", "_")] = value if eq else True
    return extra


def _client(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise ConfigError(f"--launcher slurm: `{name}` is not on PATH: this machine is not a SLURM client")
    return path


def squeue_states(job_ids: list[str]) -> dict[str, str]:
    """job id -> squeue state of the given jobs the controller still knows (recently ended ones included)."""
    if not job_ids:
        return {}
    done = subprocess.run([_client("squeue"), "-h", "-t", "all", "-o", "%i %T", "-j", ",".join(job_ids)],
                          capture_output=True, text=True, timeout=120)
    if done.returncode != 0:  # only ids the controller has forgotten: all of them ended
        if "Invalid job id" in done.stderr:
            return {}
        raise ConfigError(f"squeue: {_first(done.stderr)}")
    words = done.stdout.split()
    return dict(zip(words[::2], words[1::2]))


def ended_jobs(job_ids: list[str]):
    """Yield (job id, its last state in lower case, `ended` once the controller has forgotten it) as each job
    ends; a requeued job is waited for again."""
    pending = list(job_ids)
    while pending:
        time.sleep(POLL_S)
        states = squeue_states(pending)
        for job_id in [j for j in pending if states.get(j, "ENDED") in ENDED | {"ENDED"}]:
            pending.remove(job_id)
            yield job_id, states.get(job_id, "ENDED").lower()


def _first(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0] if lines else "no answer"


def check_cluster(cfg: SlurmConfig) -> None:
    """One query to the controller before anything is submitted: it must answer, and the partition exist."""
    try:
        done = subprocess.run([_client("sinfo"), "-h", "-o", "%P"], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise ConfigError("--launcher slurm: the SLURM controller did not answer sinfo within 60 s") from None
    if done.returncode != 0:
        raise ConfigError(f"--launcher slurm: the SLURM controller cannot be reached: {_first(done.stderr)}")
    partitions = [p.rstrip("*") for p in done.stdout.split()]
    if cfg.partition is not None and cfg.partition not in partitions:
        raise ConfigError(f"{PREFIX}partition={cfg.partition!r} is not a partition of this cluster: expected one of "
                          f"{partitions}")


class Command(submitit.helpers.Checkpointable):
    """The job's function: `python -m <module> <args>` in every task, its output appended to `log` (rank r > 0:
    `<log stem>.rank<r>.log`). Checkpointable: on preemption or at the time limit submitit requeues the job
    with this same command, which resumes (`resume=auto`)."""

    def __init__(self, module: str, args: list[str], log: Path, threads: int) -> None:
        self.module, self.args, self.log, self.threads = module, list(args), Path(log).resolve(), threads

    def __call__(self) -> int:
        rank = int(os.environ.get("SLURM_PROCID", "0"))
        log = self.log if rank == 0 else self.log.with_name(f"{self.log.stem}.rank{rank}.log")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "MLFLOW_DISABLE_TELEMETRY": "true",
               "OMP_NUM_THREADS": str(self.threads)}
        env.pop("EMPO2_RUN_NAME", None)  # a run sets it for its own ranks; never inherited from the driver
        cmd = [sys.executable, "-m", self.module, *self.args]
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            out.write(f"$ {' '.join(cmd)}  # SLURM job {os.environ.get('SLURM_JOB_ID')}, rank {rank}\n".encode())
            out.flush()
            rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
        if rc != 0:
            raise RuntimeError(f"exit {rc}: {last_line(log)}")
        return rc


@contextlib.contextmanager
def _environ(extra: dict):
    """`extra` in os.environ for the block (what sbatch, a child process, inherits), then as it was."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def job_parameters(cfg: SlurmConfig, name: str, tasks: int | None = None) -> dict:
    """submitit's SlurmExecutor parameters (its names for the sbatch options) of a job named `name`; `tasks` per
    node: the config's (`tasks_per_node`) unless given."""
    params = {"job_name": name, "nodes": cfg.nodes, "ntasks_per_node": tasks or tasks_per_node(cfg),
              "cpus_per_task": cfg.cpus_per_task, "time": cfg.time, "stderr_to_stdout": True,
              "additional_parameters": {"requeue": True, **_sbatch_options(cfg)}}
    params.update({k: v for k, v in (("partition", cfg.partition), ("account", cfg.account),
                                     ("gpus_per_node", cfg.gpus_per_node or None),
                                     ("mem", f"{cfg.mem_gb}G" if cfg.mem_gb else None)) if v is not None})
    return params


def submit(cfg: SlurmConfig, name: str, module: str, args: list[str], log: Path, folder: Path,
           env: dict | None = None, tasks: int | None = None) -> str:
    """Submit `python -m module args` as one job named `name` (`tasks` per node, default the config's), with `env`
    added to its environment; submitit's files go to `folder`. Returns the job id. `env` reaches the job the way
    the rest of the environment does, through sbatch (stored by the controller), so a secret in it is on no command
    line, log or file in `folder`."""
    executor = submitit.SlurmExecutor(folder=folder / "%j", max_num_timeout=cfg.max_requeues)
    executor.update_parameters(**job_parameters(cfg, name, tasks))
    try:
        # submitit prints sbatch's refusal; ours is one line
        with contextlib.redirect_stderr(io.StringIO()), _environ(env or {}):
            job = executor.submit(Command(module, args, log, cfg.cpus_per_task))
    except FailedJobError as e:
        raise ConfigError(f"sbatch refused job {name}: {_first(str(e))}") from None
    return str(job.job_id)

"""`train(cfg) -> summary`: one EMPO² training run, the library call behind `empo2 train`.

It wires the parts together and hands them to a Lightning Trainer: the policy inside `EMPO2Module`,
the rollout buffer inside `RolloutDataModule`, and the `RolloutWorker` (engine, environments, tip memory,
novelty counter) inside `RolloutCallback`. One Lightning epoch is one iteration.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from empo2.config import ConfigError, TrainConfig, to_dict
from empo2.models import load_policy
from empo2.utils import PeakMemory, atomic_write_bytes, atomic_write_json, make_run_dir, plural, seed_everything
from empo2.utils.errors import Interrupted
from empo2.workflows.runs import check_tracking, run_tags, tracking_uri

RANK_EXIT_S = 300  # how long a run waits, after its fit, for the ranks its launcher started to exit


def checkpoint_files(ckpt_dir: Path) -> list[Path]:
    """The checkpoint files in a folder, newest first. `last.ckpt` links to one of them (or, in a run folder
    written before it became a link, is a file itself and counts); a link is never a candidate of its own,
    nor is one left dangling by a target that was set aside."""
    files = [p for p in ckpt_dir.glob("*.ckpt") if not p.is_symlink()]
    return sorted(files, key=lambda p: p.stat().st_mtime, reverse=True)


def find_resume_checkpoint(ckpt_dir: Path) -> Path | None:
    """Newest checkpoint file of the run that loads (`weights_only=True`: nothing in the file is executed).

    A truncated or corrupt one is reported and renamed to `<name>.unreadable`: kept for inspection, and out
    of the way of the next save of that name.
    """
    for path in checkpoint_files(ckpt_dir):
        try:
            torch.load(path, map_location="cpu", weights_only=True)
            return path
        except Exception as e:  # a torn write, garbage or pickled code: fall back to an older one
            aside = path.with_name(path.name + ".unreadable")
            reason = (str(e).strip().splitlines() or [""])[0][:80]
            print(f"checkpoint {path} is unreadable ({type(e).__name__}: {reason}); moved to {aside.name}, "
                  f"trying an older one")
            with contextlib.suppress(FileNotFoundError):  # another node's process on a shared disk was first
                os.replace(path, aside)
    return None


def started_ranks() -> int:
    """How many processes of this run were started outside it, before the trainer exists: torchrun's WORLD_SIZE, or
    the tasks of an srun, which Lightning takes as its ranks unless the job is interactive (named `bash` or
    `interactive`, as Lightning's SLURMEnvironment tells). 1 where Lightning's own launcher will start the others
    (they find the run folder in EMPO2_RUN_NAME)."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if "SLURM_NTASKS" in os.environ and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        return int(os.environ["SLURM_NTASKS"])
    return 1


def resume_run_name(cfg: TrainConfig) -> str | None:
    """The run folder name: `run_name`; with `resume=auto` and no name, the newest unfinished run under
    `run_root` (a checkpoint and no summary.json), so a bare `resume=auto` never silently starts over."""
    name = cfg.run_name or os.environ.get("EMPO2_RUN_NAME")
    if not name and started_ranks() > 1:
        # each process would name its own folder after its own clock
        raise ConfigError("run_name is required when torchrun or srun starts the processes: give run_name=NAME so "
                          "every rank writes into the same run folder")
    if name or cfg.resume != "auto":
        return name
    root = Path(cfg.run_root).expanduser()
    # run folders nest one level in grids and sweeps (<grid>/<preset>-s<seed>)
    ckpts = [c for c in (*root.glob("*/checkpoints/*.ckpt"), *root.glob("*/*/checkpoints/*.ckpt"))
             if not c.is_symlink()]
    unfinished = {c.parent.parent for c in ckpts if not (c.parent.parent / "summary.json").is_file()}
    if not unfinished:
        raise ConfigError(f"resume=auto without run_name: no unfinished run under {root} to resume "
                          f"(give run_name=NAME, or resume=never for a new run)")
    newest = max(unfinished, key=lambda d: checkpoint_files(d / "checkpoints")[0].stat().st_mtime)
    print(f"resume=auto: resuming the newest unfinished run, {newest}")
    return str(newest.relative_to(root))


def _logger(cfg: TrainConfig, run_dir: Path):
    if cfg.logger.name == "none":
        return None
    from empo2.workflows.tracking import SPOOL_NAME, ResilientMLFlowLogger

    id_file = run_dir / "mlflow_run_id.txt"
    run_id = id_file.read_text().strip() if id_file.is_file() else None  # resume continues the same run
    return ResilientMLFlowLogger(experiment_name=cfg.logger.experiment, tracking_uri=tracking_uri(cfg),
                                 run_id=run_id, run_name=run_dir.name, tags=run_tags(cfg),
                                 spool=run_dir / SPOOL_NAME, retry_s=cfg.logger.retry_s)


def validation_line(cfg: TrainConfig, tasks: list, budget=None, shown: int = 8) -> str:
    """`  validation: 3 episodes of test variations, every 5 iterations and after the last; step budgets
    lifespan-longest-lived 10, find-non-living-thing 15, find-living-thing 20`: the fixed validation set by task type,
    with its step budget (`env.max_steps`, else `budget(task)` where the environment has a table), the first
    `shown` types."""
    types = list(dict.fromkeys(t.task for t in tasks))
    if cfg.env.max_steps is None and budget is None:
        named = f"task types {', '.join(types[:shown])}"
    else:
        named = "step budgets " + ", ".join(f"{t} {cfg.env.max_steps or budget(t)}" for t in types[:shown])
    more = f" and {len(types) - shown} more" if len(types) > shown else ""
    return (f"  validation: {plural(len(tasks), 'episode')} of {cfg.env.val_split} variations, every "
            f"{plural(cfg.trainer.val_every, 'iteration')} and after the last; {named}{more}")


def start_lines(cfg: TrainConfig, run_dir: Path, mlflow_run: str | None, validation: str | None = None) -> list[str]:
    """The header a run prints before its first rollout: what runs, where it goes, on what, and what validation
    plays (`validation_line`)."""
    t = cfg.trainer
    tasks = ", ".join(cfg.env.tasks) if cfg.env.tasks else "all training tasks"
    lines = [f"empo2 train: {cfg.experiment or 'the default config'} | {cfg.algo.name} (p {cfg.algo.p:g}, "
             f"q {cfg.algo.q:g}, delta {cfg.algo.delta:g}, beta {cfg.algo.beta_start:g}->{cfg.algo.beta_end:g}) | "
             f"model {cfg.model.name} | {cfg.env.name}: {tasks}",
             f"  {plural(t.iterations, 'iteration')} of {plural(cfg.rollout.tasks_per_batch, 'task')} x "
             f"{plural(cfg.rollout.group_size, 'rollout')} on {t.accelerator} x{t.devices * t.num_nodes}, "
             f"seed {cfg.seed} | run folder {run_dir}"]
    if validation:
        lines.append(validation)
    if mlflow_run:
        lines.append(f"  MLflow run {mlflow_run} in {tracking_uri(cfg)} (experiment {cfg.logger.experiment})")
    return lines


def state_fingerprint(model) -> str:
    """sha256 over every parameter's bytes, in name order; a sharded (FSDP) parameter is gathered first, so every
    rank takes part."""
    import hashlib

    from torch.distributed.tensor import DTensor

    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        p = p.full_tensor() if isinstance(p, DTensor) else p
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# (panel title, y label, y range or None, metrics): score and success on their fixed scales; the return
# panel keeps the extrinsic part and the novelty bonus apart, so a curve never mixes the two units
CURVE_PANELS = (
    ("Score", "score (0-100)", (0, 100), ("val/score_nomem", "val/score_mem", "val_train/score_nomem",
                                          "rollout/score", "rollout/score_mem", "rollout/score_nomem")),
    ("Success", "success rate", (0, 1), ("val/success_nomem", "val/success_mem", "val_train/success_nomem",
                                         "rollout/success")),
    ("Return", "return per episode", None, ("rollout/ext_return", "rollout/intrinsic_return")),
)


def plot_curves(history: list[dict], path: Path) -> None:
    """learning_curve.png: one panel per CURVE_PANELS entry against the iteration (-1: before training)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(CURVE_PANELS), figsize=(15, 4))
    for ax, (title, ylabel, ylim, keys) in zip(axes, CURVE_PANELS):
        for key in keys:
            pts = [(h["iteration"], h[key]) for h in history if key in h]
            if pts:
                ax.plot(*zip(*pts), marker="o", markersize=3, label=key)
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.set_ylabel(ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if ylim:
            ax.set_ylim(ylim[0] - 0.02 * ylim[1], ylim[1] * 1.02)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def train(cfg: TrainConfig, callbacks: list | None = None, started: float | None = None) -> dict:
    """Run one training; `callbacks` are extra Lightning callbacks (early stopping, custom logging). `started`: the
    `time.perf_counter()` at which the caller began the run (`empo2 train` passes its own start, so the start-up
    phase and the wall time count its imports and the config's composition), else this call."""
    from empo2.workflows.preflight import preflight

    start = time.perf_counter() if started is None else started
    t0 = time.time() - (time.perf_counter() - start)
    preflight(cfg)  # the machine's side of the config, before the heavy imports and any folder
    run_name = resume_run_name(cfg)
    check_tracking(cfg)
    import lightning as L

    from empo2.lit.callbacks import RolloutCallback
    from empo2.lit.checkpoint_io import LAST, AtomicCheckpointIO, IterationCheckpoint, remove_torn_writes
    from empo2.lit.data import RolloutDataModule
    from empo2.lit.module import EMPO2Module
    from empo2.lit.progress import IterationProgressBar, PhaseTimes
    from empo2.lit.strategy import build_strategy
    from empo2.rollout.build import (
        build_worker,
        generation_logprobs_exact,
        records_engine_logprobs,
        start_envs,
        validation_tasks,
    )

    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    seed_everything(cfg.seed)
    val_tasks = validation_tasks(cfg)
    train_val_tasks = validation_tasks(cfg, on_train=True) if cfg.trainer.val_train else []
    t = cfg.trainer
    # as many environments as one collection plays at once: the training batch, or a validation list (lock step)
    n_envs = max(cfg.rollout.tasks_per_batch * cfg.rollout.group_size, len(val_tasks), len(train_val_tasks))
    starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="empo2-envs")
    starting = starter.submit(start_envs, cfg, n_envs)  # ScienceWorld's JVMs start while the model loads
    starter.shutdown(wait=False)
    # both before the run folder: a model that cannot load, or environments that cannot start, leave none behind
    try:
        model, tok = load_policy(cfg.model)
    except BaseException:
        if starting.exception() is None:  # waits for the start, so that no JVM outlives the failed load
            for env in starting.result():
                env.close()
        raise
    envs = starting.result()  # raises what kept an environment from starting
    run_dir = make_run_dir(cfg.run_root, run_name)
    # DDP worker processes rerun this and must find the same folder; the caller's value comes back after
    # the fit, so a second train() in the same process does not write into this run's folder
    outer_run_name = os.environ.get("EMPO2_RUN_NAME")
    os.environ["EMPO2_RUN_NAME"] = run_name or run_dir.name
    datamodule = RolloutDataModule(t.ppo_epochs, t.mini_batch_size, t.micro_batch_size, cfg.seed,
                                   t.micro_batch_tokens)
    ref_policy = None
    if cfg.algo.kl_coef > 0 and cfg.model.lora_r == 0:  # with LoRA the reference is the base, adapters off
        import copy

        ref_policy = copy.deepcopy(model).eval().requires_grad_(False)
    model.train()  # from_pretrained returns eval mode; Lightning keeps whatever mode it finds
    if t.gradient_checkpointing:  # non-reentrant: no input that requires grad is needed (frozen embeddings, LoRA)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    module = EMPO2Module(model, tok, cfg.algo, cfg.trainer, datamodule.buffer, ref_policy=ref_policy,
                         temperature=cfg.rollout.temperature)
    worker = build_worker(cfg, model, tok, envs, with_engine=False)
    times = PhaseTimes(start)
    rollout_cb = RolloutCallback(cfg, worker, datamodule, val_tasks, train_val_tasks, times)
    ckpt_dir = run_dir / "checkpoints"
    ckpt_cb = IterationCheckpoint(ckpt_dir, cfg.trainer.ckpt_every, times)
    logger = _logger(cfg, run_dir)
    progress = IterationProgressBar(rollout_cb)  # iteration k/N, return, success, memory size; a line per iteration
    trainer = L.Trainer(
        max_epochs=t.iterations, accelerator=t.accelerator, devices=t.devices, num_nodes=t.num_nodes,
        strategy=build_strategy(cfg, model), precision=t.precision,
        logger=logger if logger is not None else False,
        callbacks=[rollout_cb, ckpt_cb, progress, *(callbacks or [])], default_root_dir=str(run_dir),
        log_every_n_steps=1,
        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
        enable_model_summary=False, detect_anomaly=cfg.debug.detect_anomaly, plugins=[AtomicCheckpointIO()])
    if logger is not None and trainer.is_global_zero:  # written at once, so a killed run resumes into the same run
        (run_dir / "mlflow_run_id.txt").write_text(logger.run_id)
    if trainer.is_global_zero:
        validation = validation_line(cfg, val_tasks, getattr(worker.envs[0], "budget", None))
        print("\n".join(start_lines(cfg, run_dir, logger.run_id if logger is not None else None, validation)),
              flush=True)
    ckpt_path = Path(cfg.resume).expanduser() if cfg.resume not in ("never", "auto") else None
    if cfg.resume == "auto" and ckpt_dir.is_dir():
        for torn in remove_torn_writes(ckpt_dir):
            print(f"removed {torn}, a checkpoint write that was interrupted before it completed")
        ckpt_path = find_resume_checkpoint(ckpt_dir)
    if ckpt_path:
        print(f"resuming from {ckpt_path}")
    peak_memory = PeakMemory().start()  # the environments' and engine's processes are up; the model is loaded
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=str(ckpt_path) if ckpt_path else None,
                    weights_only=True)
    except Interrupted as e:
        e.run_dir = run_dir  # the CLI names it in its resume hint
        raise
    finally:
        peak_rss_gib = peak_memory.stop()
        for env in worker.envs:
            env.close()
        if outer_run_name is None:
            os.environ.pop("EMPO2_RUN_NAME", None)
        else:
            os.environ["EMPO2_RUN_NAME"] = outer_run_name
    memory = worker.memory
    if memory is not None and trainer.is_global_zero:
        memory.save(run_dir / "memory")  # the tips the run ends with, for `empo2 eval/adapt`
    if trainer.world_size > 1:  # one fingerprint per rank: data-parallel ranks must agree exactly
        atomic_write_json(run_dir / f"rank{trainer.global_rank}.json", {
            "weights_sha256": state_fingerprint(module.policy),
            "memory_records": [r.text for r in memory.records()] if memory is not None else [],
            "novelty_states": len(worker.novelty)})

    history = rollout_cb.history
    final = {}
    for h in history:
        final.update({k: v for k, v in h.items() if k != "iteration"})
    final["time/total_s"] = time.time() - t0
    phases = dict(times.report(), peak_rss_gib=peak_rss_gib)  # this process's wall time, phase by phase
    plot_path, config_path = run_dir / "learning_curve.png", run_dir / "config.yaml"
    if trainer.is_global_zero:
        from omegaconf import OmegaConf

        plot_curves(history, plot_path)
        # the resolved config, readable beside the run (and an MLflow artifact)
        atomic_write_bytes(config_path, OmegaConf.to_yaml(to_dict(cfg)).encode())
    last = ckpt_dir / LAST
    summary = {"metrics": final, "history": history, "config": to_dict(cfg),
               "checkpoint": str(last) if last.is_file() else None,
               "mlflow_run_id": logger.run_id if logger is not None else None,
               "mlflow_experiment_id": logger.experiment_id if logger is not None else None,
               "mlflow_tracking_uri": logger._tracking_uri if logger is not None else None,
               # the engine's log-probs were the old log-probs (no scoring pass: a sampler/trainer gap of 0)
               "logprobs_exact": cfg.algo.update_policy and generation_logprobs_exact(cfg),
               # the update scored its samples but the engine kept no log-probs to measure the gap against
               "gap_unmeasured": cfg.algo.update_policy and not records_engine_logprobs(cfg),
               "phases": phases, "run_dir": str(run_dir), "plot": str(plot_path), "config_file": str(config_path),
               "summary_path": str(run_dir / "summary.json")}
    if trainer.is_global_zero:
        atomic_write_json(summary["summary_path"], summary)
    # the ranks Lightning's own launcher started (none under torchrun or srun) are not waited for by Lightning: the
    # run ends once they have, so a sweep's next trial or a reader of rank<r>.json never meets one still running;
    # one that hangs after the fit (all it has left is writing its rank file and exiting) is stopped
    for proc in getattr(trainer.strategy.launcher, "procs", ()):
        try:
            proc.wait(timeout=RANK_EXIT_S)
        except subprocess.TimeoutExpired:
            print(f"rank process {proc.pid} was still running {RANK_EXIT_S} s after the fit: stopped")
            proc.kill()
            proc.wait()
    return summary

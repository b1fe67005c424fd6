"""`RolloutCallback`: runs each iteration's rollouts through the `RolloutWorker`, validates, and keeps the run's
history.

One Lightning epoch is one EMPO² iteration. When the DataModule's stream is opened it asks this callback for the
iteration's data (`produce_iteration`), which reads as the iteration runs: this rank's share of task instances is
played by the worker (tips, memory modes, novelty bonus) under the iteration's `training_spec`, the new tips are
all-gathered so every rank ends with an identical memory, the old log-probs are computed on the behaviour prompts,
and the DataModule's buffer is filled. At the epoch's end the callback syncs the new weights into the generation
engine and, every `val_every` iterations, scores the fixed validation list.

Every draw depends only on (seed, iteration, rank), never on a stream that has run for a while, so
a resumed run replays exactly what an uninterrupted one would have done.
"""

from __future__ import annotations

import contextlib
import time

import lightning as L
import numpy as np
import torch
import torch.distributed as dist

from empo2.algo.stats import first_visit_gain
from empo2.config import TrainConfig, current_metric
from empo2.envs import TaskSpec, get_catalogue
from empo2.lit.data import RolloutDataModule, derive_seed
from empo2.lit.progress import Phase, PhaseTimes
from empo2.lit.strategy import export_ranks, unsharded
from empo2.rollout.build import engine_for
from empo2.rollout.engines import full_named_tensors
from empo2.rollout.spec import CollectionSpec, scoring_spec, training_spec
from empo2.rollout.types import RolloutBatch
from empo2.rollout.worker import RolloutWorker
from empo2.utils import settle_startup_heap
from empo2.utils.faults import maybe_fail

# the worker's part of this callback's checkpointed state, which checkpoints before the worker held it stored at the
# top level of the callback's state
WORKER_STATE_KEYS = ("novelty", "memory")


def worker_state(callback_state: dict) -> dict:
    """The `RolloutWorker` state inside a `RolloutCallback` checkpoint state, of either layout: under "worker", or
    (checkpoints written before the worker owned the memory and the novelty counter) at the top level."""
    if "worker" in callback_state:
        return callback_state["worker"]
    return {k: callback_state.get(k) for k in WORKER_STATE_KEYS}


def generation_weights(trainer: L.Trainer, engine):
    """Under FSDP, the policy's full weights while an engine that generates with the policy itself (HF) runs,
    gathered once rather than per forward (`unsharded`). An engine with its own copy of the weights (vLLM) needs
    none: every rank keeps only its shard of the policy through rollouts and validation."""
    return unsharded(trainer.lightning_module.policy) if engine.generates_with_policy else contextlib.nullcontext()


class RolloutCallback(L.Callback):
    def __init__(self, cfg: TrainConfig, worker: RolloutWorker, datamodule: RolloutDataModule,
                 val_tasks: list[TaskSpec], train_val_tasks: list[TaskSpec] = (), times: PhaseTimes | None = None):
        self.cfg, self.worker, self.datamodule, self.val_tasks = cfg, worker, datamodule, val_tasks
        self.train_val_tasks = list(train_val_tasks)  # `trainer.val_train`: the training instances, tip-free
        self.catalogue = get_catalogue(cfg.env.name)
        self.history: list[dict[str, float]] = []  # per-iteration rollout and validation numbers
        # Iterations completed. Our own counter, checkpointed with the rest of our state: on resume,
        # Lightning builds the first iterator while `current_epoch` still names the finished epoch.
        self.iteration = 0
        self.env_steps = 0  # environment steps of all training rollouts so far, every rank: the x of sample efficiency
        # An engine that holds its own weights (vLLM) was built from the initial policy, before Lightning
        # restored any checkpoint: the first rollout of every fit syncs it, so a resumed run never samples
        # from the weights it started with.
        self._engine_synced = False
        self._sync_s = 0.0  # seconds spent loading weights into the engine since the last iteration's stats
        self.phase = Phase()  # rollouts, update or validation, with its count (the progress bar shows it)
        self.times = times or PhaseTimes(time.perf_counter())  # where the run's time goes (MLflow's time/*)
        self._startup: dict[str, float] = {}  # time/startup_s, logged with the fit's first rollouts
        self._update_t0: float | None = None  # when this iteration's rollouts were handed to the update
        # p = 1 (memory only): no group holds a tip-free rollout to set the tips against, so each training rollout
        # is kept as (instance, iteration, score, carried tips) for `first_visit_gain`; this rank's rollouts only
        self.visits: list[tuple] | None = [] if cfg.algo.p == 1 and worker.memory is not None else None

    def setup(self, trainer: L.Trainer, pl_module, stage: str) -> None:
        export_ranks(trainer)  # before the engine: vLLM takes its rank from the environment
        # Built here, once the strategy has opened the process group: under ddp/fsdp vLLM then joins it (an
        # engine per rank) rather than opening a one-process group of its own, which the strategy would then
        # take for the whole world.
        engine = self.worker.engine
        if engine is None:
            engine = engine_for(self.cfg, pl_module.policy, self.worker.builder.tokenizer)
        self.worker.attach_engine(engine, trainer.global_rank)
        self._engine_synced = False

    def on_fit_start(self, trainer: L.Trainer, pl_module) -> None:
        # After the strategy set-up, before the first rollout is fetched. A resumed run (ckpt_path) logged its
        # baseline already; FSDP restores only after this hook, so the iteration counter cannot tell.
        settle_startup_heap()  # what the start-up built frozen, the collector on again (`empo2.utils`)
        self._startup = self.times.since("startup", self.times.start)  # processes, model, engine, envs are up
        if self.cfg.trainer.val_before_train and trainer.ckpt_path is None:
            with generation_weights(trainer, self.worker.engine):
                stats = self.validate(-1)
            self._log(trainer, -1, dict(stats, **{"train/env_steps": 0.0}))

    # ------------------------------------------------------------------------------ one iteration
    def produce_iteration(self, trainer: L.Trainer) -> None:
        """One iteration's data, which the DataModule's stream asks for when Lightning opens it: this rank's
        rollouts, their old log-probs (before any update), and the buffer the update streams mini-batches from."""
        cfg, it, pl_module = self.cfg, self.iteration, trainer.lightning_module
        if it >= cfg.trainer.iterations:  # a finished run resumed: Lightning still opens the stream once
            self.datamodule.set_rollouts([], [], it)  # no rank has a sample: nothing to agree on
            return
        spec = training_spec(cfg, it, trainer.world_size)
        batch = self.collect_rollouts(trainer, spec)
        t0 = time.perf_counter()
        if cfg.algo.update_policy:  # on the shards under FSDP, forwards padded to the busiest rank's
            old = pl_module.old_logprobs(batch.samples, cfg.trainer.micro_batch_size)
            samples = batch.samples
        else:  # memory-only agent: the iteration is its rollouts (and tips); nothing to train on
            old, samples = [], []
        times = self.times.since("old_logprobs", t0)
        n_mini = self.datamodule.set_rollouts(samples, old, it, trainer.global_rank, trainer.world_size,
                                              pl_module.device)
        self.phase.set("update", 0, n_mini * cfg.trainer.ppo_epochs, it)
        self._log_iteration(trainer, spec, batch, old, times)
        self._update_t0 = time.perf_counter()

    def collect_rollouts(self, trainer: L.Trainer, spec: CollectionSpec) -> RolloutBatch:
        """This rank's share of the iteration's task instances (the same draw on every rank), played by the
        worker; under data parallelism every rank's new tips are merged into every rank's memory."""
        cfg, it, rank, world = self.cfg, self.iteration, trainer.global_rank, trainer.world_size
        tasks = self.catalogue.sample(cfg.rollout.tasks_per_batch * world, cfg.env.train_split,
                                      seed=derive_seed(cfg.seed, it), tasks=cfg.env.tasks or None,
                                      variations=cfg.env.train_variations)
        generator = torch.Generator().manual_seed(derive_seed(cfg.seed, it, rank, 1))
        if not self._engine_synced:  # runs after the restore, on fresh starts and resumes alike
            self._sync_engine(trainer.lightning_module)
        mine = tasks[rank::world]
        with generation_weights(trainer, self.worker.engine):
            batch = self._collect("rollouts", 0, len(mine) * cfg.rollout.group_size, spec, mine,
                                  cfg.rollout.group_size, it, generator)
        self.worker.engine.sleep()  # vLLM with engine.sleep_mode frees its memory for the update
        maybe_fail("rollout", it)
        if world > 1 and self.worker.memory is not None:  # without memory (memory.enabled=false) no tips
            self._share_tips(batch.new_tips)
            batch.stats["memory/size"] = float(len(self.worker.memory))
        return batch

    def _log_iteration(self, trainer: L.Trainer, spec: CollectionSpec, batch: RolloutBatch, old: list,
                       times: dict[str, float]) -> None:
        """The iteration's rollout numbers, with the environment steps of every rank so far, the schedule's beta,
        where the time went and the sampler/trainer log-prob gap."""
        it, pl_module = self.iteration, trainer.lightning_module
        steps = torch.tensor([len(batch.samples)], device=pl_module.device)  # one sample per environment step
        if trainer.world_size > 1:
            dist.all_reduce(steps, op=dist.ReduceOp.SUM)
        self.env_steps += int(steps.item())
        stats = dict(batch.stats, **{"train/iteration": float(it), "train/env_steps": float(self.env_steps),
                                     "algo/beta": spec.beta}, **times, **self._startup)
        stats.update(self.times.add(generate=batch.stats["time/generate_s"], env=batch.stats["time/env_s"],
                                    tips_retrieval=batch.stats["time/tips_s"] + batch.stats["time/memory_s"]))
        self._startup = {}
        stats.update(pl_module.logprob_gap(batch.samples, old))  # every rank's samples
        if self.visits is not None:  # the estimate over the run so far: its last value is the run's
            self.visits += [(f"{tr.task}#{tr.variation}", it, tr.score, tr.carried_tips) for tr in batch.trajectories]
            gain, instances = first_visit_gain(*zip(*self.visits))
            stats["rollout/first_visit_gain_instances"] = float(instances)
            if instances:
                stats["rollout/first_visit_gain"] = gain
        stats["env/restarts"] = float(sum(int(getattr(env, "restarts", 0)) for env in self.worker.envs))
        stats["time/weight_sync_s"], self._sync_s = self._sync_s, 0.0  # the syncs since the last iteration's stats
        self._log(trainer, it, stats)

    def _sync_engine(self, pl_module) -> None:
        # full tensors with Hugging Face names (FSDP gathered, LoRA merged); lazy, so HFEngine costs nothing
        start = time.perf_counter()
        self.worker.engine.update_weights(full_named_tensors(pl_module.policy))
        self._sync_s += time.perf_counter() - start
        self.times.since("weight_sync", start)
        self._engine_synced = True

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if batch.last:  # the micro-batch that ends a mini-batch: one optimiser step done
            self.phase.advance()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module) -> None:
        stats = self.times.since("update", self._update_t0) if self._update_t0 is not None else {}
        self._update_t0 = None
        self._sync_engine(pl_module)
        it = self.iteration
        if (it + 1) % self.cfg.trainer.val_every == 0 or it + 1 == self.cfg.trainer.iterations:
            with generation_weights(trainer, self.worker.engine):
                stats.update(self.validate(it))
        if stats:
            self._log(trainer, it, stats)
        self.iteration += 1

    def validate(self, iteration: int) -> dict[str, float]:
        """Score the fixed validation list (`val/*`), and with `trainer.val_train` the training instances
        (`val_train/*`), without memory and, with `trainer.val_mem`, with it; each instance's score as
        `<prefix>/score_<mode>/<task>-<variation>` besides the mean, and the time it took (`time/validation_s`)."""
        t0, out = time.perf_counter(), {}
        val_mem = self.cfg.trainer.val_mem and self.worker.memory is not None
        modes = [("nomem", False)] + ([("mem", True)] if val_mem else [])
        lists = [("val", self.val_tasks, ())] + ([("val_train", self.train_val_tasks, (1,))]
                                                 if self.train_val_tasks else [])
        total, done = len(modes) * sum(len(tasks) for _, tasks, _ in lists), 0
        for prefix, tasks, salt in lists:
            for name, mem in modes:
                generator = torch.Generator().manual_seed(derive_seed(self.cfg.seed, 2**20, name == "mem", *salt))
                batch = self._collect("validation", done, total, scoring_spec(self.cfg, mem), tasks, 1,
                                      iteration, generator)
                done += len(tasks)
                out[f"{prefix}/score_{name}"] = batch.stats["rollout/score"]
                # and each instance's own (one episode each), for intervals that resample instances within a seed
                out.update({f"{prefix}/score_{name}/{tr.task}-{tr.variation}": tr.score for tr in batch.trajectories})
                out[f"{prefix}/success_{name}"] = batch.stats["rollout/success"]
                out[f"{prefix}/episode_len_{name}"] = batch.stats["rollout/episode_len"]
        return dict(out, **self.times.since("validation", t0))

    # ------------------------------------------------------------------------------------ helpers
    def _collect(self, phase: str, before: int, total: int, spec: CollectionSpec, tasks: list[TaskSpec],
                 group_size: int, iteration: int, generator: torch.Generator) -> RolloutBatch:
        """`worker.collect(...)` with its finished episodes counted into `phase`, after the `before` of `total`
        that earlier calls of the same phase played."""
        self.phase.set(phase, before, total, iteration)
        return self.worker.collect(spec, tasks, group_size, iteration, generator, on_step=lambda finished, _:
                                   self.phase.set(phase, before + finished, total, iteration))

    def _share_tips(self, entries) -> None:
        """All-gather each rank's new tips and merge them in a rank-independent order."""
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, entries)
        texts, vectors, metas = [], [], []
        for t, v, m in gathered:
            texts += t
            metas += m
            vectors.append(v)
        if texts:
            self.worker.memory.merge(texts, np.concatenate(vectors), metas)

    def _log(self, trainer: L.Trainer, iteration: int, stats: dict[str, float]) -> None:
        self.history.append(dict(stats, iteration=iteration))
        if trainer.logger is not None and trainer.is_global_zero:
            trainer.logger.log_metrics(stats, step=iteration)

    # -------------------------------------------------------------------------- checkpoint state
    def state_dict(self) -> dict:
        return {"worker": self.worker.state_dict(), "history": self.history, "iteration": self.iteration,
                "env_steps": self.env_steps, "visits": self.visits}

    def load_state_dict(self, state: dict) -> None:
        self.worker.load_state_dict(worker_state(state))  # either checkpoint layout
        # in today's metric names, whatever version wrote the checkpoint, so the run's history reads one way
        self.history = [{current_metric(k): v for k, v in row.items()} for row in state.get("history", [])]
        self.iteration = int(state["iteration"])
        self.env_steps = int(state["env_steps"])
        if self.visits is not None:
            self.visits = [tuple(v) for v in state.get("visits") or []]

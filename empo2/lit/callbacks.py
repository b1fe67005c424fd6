"""`RolloutCallback`: produces each iteration's rollouts, validates, and owns the non-parametric state.

One Lightning epoch is one EMPO² iteration. When the DataModule's stream is iterated, `produce`
samples this rank's share of task instances, plays them (tips, memory modes, novelty bonus),
all-gathers the new tips so every rank ends with an identical memory, computes the old log-probs on
the behaviour prompts and fills the DataModule's buffer. At the epoch's end the callback syncs the
new weights into the generation engine and, every `val_every` iterations, scores the fixed
validation list.

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

from empo2.algo import core_algos
from empo2.algo.stats import first_visit_gain
from empo2.config import TrainConfig
from empo2.envs import TaskSpec, get_catalogue
from empo2.lit.data import RolloutDataModule, derive_seed
from empo2.lit.progress import Phase, PhaseTimes
from empo2.lit.strategy import export_ranks, unsharded
from empo2.rollout.build import engine_for
from empo2.rollout.collector import RolloutCollector
from empo2.rollout.engines import full_named_tensors
from empo2.utils.faults import maybe_fail


def _to_torch(obj):
    """numpy arrays -> tensors, so checkpoints load with torch.load(weights_only=True)."""
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(obj))
    if isinstance(obj, dict):
        return {k: _to_torch(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_torch(v) for v in obj)
    return obj


def _to_numpy(obj):
    if isinstance(obj, torch.Tensor):
        return obj.numpy()
    if isinstance(obj, dict):
        return {k: _to_numpy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_numpy(v) for v in obj)
    return obj


def generation_weights(trainer: L.Trainer, engine):
    """Under FSDP, the policy's full weights while an engine that generates with the policy itself (HF) runs,
    gathered once rather than per forward (`unsharded`). An engine with its own copy of the weights (vLLM) needs
    none: every rank keeps only its shard of the policy through rollouts and validation."""
    return unsharded(trainer.lightning_module.policy) if engine.generates_with_policy else contextlib.nullcontext()


class RolloutCallback(L.Callback):
    def __init__(self, cfg: TrainConfig, collector: RolloutCollector, datamodule: RolloutDataModule,
                 val_tasks: list[TaskSpec], train_val_tasks: list[TaskSpec] = (), times: PhaseTimes | None = None):
        self.cfg, self.collector, self.datamodule, self.val_tasks = cfg, collector, datamodule, val_tasks
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
        self.visits: list[tuple] | None = [] if cfg.algo.p == 1 and collector.memory is not None else None

    def setup(self, trainer: L.Trainer, pl_module, stage: str) -> None:
        self.collector.rank = trainer.global_rank
        export_ranks(trainer)  # before the engine: vLLM takes its rank from the environment
        if self.collector.engine is None:
            # Built here, once the strategy has opened the process group: under ddp/fsdp vLLM then joins it (an
            # engine per rank) rather than opening a one-process group of its own, which the strategy would then
            # take for the whole world.
            self.collector.engine = engine_for(self.cfg, pl_module.policy, self.collector.builder.tokenizer)
        self._engine_synced = False
        self.datamodule.producer = lambda: self.produce(trainer, pl_module)

    def on_fit_start(self, trainer: L.Trainer, pl_module) -> None:
        # After the strategy set-up, before the first rollout is fetched. A resumed run (ckpt_path) logged its
        # baseline already; FSDP restores only after this hook, so the iteration counter cannot tell.
        self._startup = self.times.since("startup", self.times.start)  # processes, model, engine, envs are up
        if self.cfg.trainer.val_before_train and trainer.ckpt_path is None:
            with generation_weights(trainer, self.collector.engine):
                stats = self.validate(-1)
            self._log(trainer, -1, dict(stats, **{"train/env_steps": 0.0}))

    # ------------------------------------------------------------------------------ one iteration
    def produce(self, trainer: L.Trainer, pl_module) -> None:
        """This iteration's rollouts, old log-probs and mini-batch count, into the DataModule's buffer."""
        cfg, it = self.cfg, self.iteration
        if it >= cfg.trainer.iterations:  # a finished run resumed: Lightning still opens the stream once
            self.datamodule.set_rollouts([], [], it)  # no rank has a sample: nothing to agree on
            return
        rank, world = trainer.global_rank, trainer.world_size
        # the schedule ends on the last iteration that runs (iterations - 1), so that one uses beta_end
        self.collector.settings.beta = core_algos.beta_at(it, cfg.trainer.iterations - 1, cfg.algo.beta_start,
                                                          cfg.algo.beta_end, cfg.algo.beta_schedule)
        tasks = self.catalogue.sample(cfg.rollout.tasks_per_batch * world, cfg.env.train_split,
                                      seed=derive_seed(cfg.seed, it), tasks=cfg.env.tasks or None,
                                      variations=cfg.env.train_variations)
        generator = torch.Generator().manual_seed(derive_seed(cfg.seed, it, rank, 1))
        self.collector.add_tips = world == 1
        if not self._engine_synced:  # produce runs after the restore, on fresh starts and resumes alike
            self._sync_engine(pl_module)
        mine = tasks[rank::world]
        with generation_weights(trainer, self.collector.engine):
            batch = self._collect("rollouts", 0, len(mine) * cfg.rollout.group_size, mine, cfg.rollout.group_size, it,
                                  generator)
        self.collector.engine.sleep()  # vLLM with engine.sleep_mode frees its memory for the update
        maybe_fail("rollout", it)
        if world > 1 and self.collector.memory is not None:  # without memory (memory.enabled=false) no tips
            self._share_tips(batch.new_tips)
            batch.stats["memory/size"] = float(len(self.collector.memory))

        t0 = time.perf_counter()
        if cfg.algo.update_policy:  # on the shards under FSDP, forwards padded to the busiest rank's
            old = pl_module.old_logprobs(batch.samples, cfg.trainer.micro_batch_size)
            samples = batch.samples
        else:  # memory-only agent: the iteration is its rollouts (and tips); nothing to train on
            old, samples = [], []
        times = self.times.since("old_logprobs", t0)
        n_mini = self.datamodule.set_rollouts(samples, old, it, rank, world, pl_module.device)
        self.phase.set("update", 0, n_mini * cfg.trainer.ppo_epochs, it)
        steps = torch.tensor([len(batch.samples)], device=pl_module.device)  # one sample per environment step
        if world > 1:
            dist.all_reduce(steps, op=dist.ReduceOp.SUM)
        self.env_steps += int(steps.item())

        stats = dict(batch.stats, **{"train/iteration": float(it), "train/env_steps": float(self.env_steps),
                                     "algo/beta": self.collector.settings.beta}, **times, **self._startup)
        stats.update(self.times.add(generate=batch.stats["time/generate_s"], env=batch.stats["time/env_s"],
                                    tips_retrieval=batch.stats["time/tips_s"] + batch.stats["time/memory_s"]))
        self._startup = {}
        stats.update(pl_module.logprob_gap(batch.samples, old))  # this rank's samples
        if self.visits is not None:  # the estimate over the run so far: its last value is the run's
            self.visits += [(f"{tr.task}#{tr.variation}", it, tr.score, tr.carried_tips) for tr in batch.trajectories]
            gain, instances = first_visit_gain(*zip(*self.visits))
            stats["rollout/first_visit_gain_instances"] = float(instances)
            if instances:
                stats["rollout/first_visit_gain"] = gain
        stats["env/restarts"] = float(self._env_restarts())
        stats["time/weight_sync_s"], self._sync_s = self._sync_s, 0.0  # the syncs since the last iteration's stats
        self._log(trainer, it, stats)
        self._update_t0 = time.perf_counter()

    def _sync_engine(self, pl_module) -> None:
        # full tensors with Hugging Face names (FSDP gathered, LoRA merged); lazy, so HFEngine costs nothing
        start = time.perf_counter()
        self.collector.engine.update_weights(full_named_tensors(pl_module.policy))
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
            with generation_weights(trainer, self.collector.engine):
                stats.update(self.validate(it))
        if stats:
            self._log(trainer, it, stats)
        self.iteration += 1

    def validate(self, iteration: int) -> dict[str, float]:
        """Score the fixed validation list (`val/*`), and with `trainer.val_train` the training instances
        (`val_train/*`), without memory and, with `trainer.val_mem`, with it; each instance's score as
        `<prefix>/score_<mode>/<task>-<variation>` besides the mean, and the time it took (`time/validation_s`)."""
        t0, out = time.perf_counter(), {}
        with_memory = self.cfg.trainer.val_mem and self.collector.memory is not None
        modes = [("nomem", False)] + ([("mem", True)] if with_memory else [])
        lists = [("val", self.val_tasks, ())] + ([("val_train", self.train_val_tasks, (1,))]
                                                 if self.train_val_tasks else [])
        total, done = len(modes) * sum(len(tasks) for _, tasks, _ in lists), 0
        for prefix, tasks, salt in lists:
            for name, use_memory in modes:
                generator = torch.Generator().manual_seed(derive_seed(self.cfg.seed, 2**20, name == "mem", *salt))
                saved = self.collector.settings.temperature
                self.collector.settings.temperature = self.cfg.rollout.val_temperature
                try:
                    batch = self._collect("validation", done, total, tasks, 1, iteration, generator, evaluate=True,
                                          use_memory=use_memory)
                finally:
                    self.collector.settings.temperature = saved
                done += len(tasks)
                out[f"{prefix}/score_{name}"] = batch.stats["rollout/score"]
                # and each instance's own (one episode each), for intervals that resample instances within a seed
                out.update({f"{prefix}/score_{name}/{tr.task}-{tr.variation}": tr.score for tr in batch.trajectories})
                out[f"{prefix}/success_{name}"] = batch.stats["rollout/success"]
                out[f"{prefix}/episode_len_{name}"] = batch.stats["rollout/episode_len"]
        return dict(out, **self.times.since("validation", t0))

    # ------------------------------------------------------------------------------------ helpers
    def _collect(self, phase: str, before: int, total: int, tasks: list[TaskSpec], group_size: int, iteration: int,
                 generator: torch.Generator, **kwargs):
        """`collector.collect(...)` with its finished episodes counted into `phase`, after the `before` of `total`
        that earlier calls of the same phase played."""
        self.phase.set(phase, before, total, iteration)
        return self.collector.collect(tasks, group_size, iteration, generator, **kwargs, on_step=lambda finished, _:
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
            self.collector.memory.merge(texts, np.concatenate(vectors), metas)

    def _env_restarts(self) -> int:
        return sum(int(getattr(env, "restarts", 0)) for env in self.collector.envs)

    def _log(self, trainer: L.Trainer, iteration: int, stats: dict[str, float]) -> None:
        self.history.append(dict(stats, iteration=iteration))
        if trainer.logger is not None and trainer.is_global_zero:
            trainer.logger.log_metrics(stats, step=iteration)

    # -------------------------------------------------------------------------- checkpoint state
    def state_dict(self) -> dict:
        memory = self.collector.memory
        return {"novelty": self.collector.novelty.state_dict(),
                "memory": _to_torch(memory.state_dict()) if memory is not None else None,
                "history": self.history, "iteration": self.iteration, "env_steps": self.env_steps,
                "visits": self.visits}

    def load_state_dict(self, state: dict) -> None:
        self.collector.novelty.load_state_dict(state["novelty"])
        if state.get("memory") is not None and self.collector.memory is not None:
            self.collector.memory.load_state_dict(_to_numpy(state["memory"]))
        self.history = list(state.get("history", []))
        self.iteration = int(state["iteration"])
        self.env_steps = int(state["env_steps"])
        if self.visits is not None:
            self.visits = [tuple(v) for v in state.get("visits") or []]

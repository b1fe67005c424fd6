"""The console while a run trains: Lightning's rich bar, numbered as EMPO² iterations, counting the phase the
iteration is in (rollouts, update, validation) in its own unit, plus one plain line per iteration (readable
in a log file or a non-terminal, where the live bar is left out); and where the run's time went, phase by phase,
for MLflow (per iteration) and the closing report (over the run)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from lightning.pytorch.callbacks import RichProgressBar

# what each phase counts: finished episodes while playing, optimiser steps while updating
PHASE_UNITS = {"rollouts": "episodes", "update": "steps", "validation": "episodes"}
# (history key, label, format) of the numbers the plain line shows; the bar shows those labelled BAR_STATS
STATS = (("rollout/score", "score", ".1f"), ("rollout/success", "success", ".2f"),
         ("rollout/score_mem", "with tips", ".1f"), ("rollout/score_nomem", "tip-free", ".1f"),
         ("val/score_nomem", "val", ".1f"), ("memory/size", "memory", ".0f"))
BAR_STATS = ("score", "success", "memory")


# (key, label) of the phases a run's wall time is split into: MLflow gets `time/<key>_s` per iteration, the closing
# report the run's totals. Generation, environment and tips count the training rollouts (validation's are its own).
PHASES = (("startup", "start-up"), ("generate", "generation"), ("env", "environment"),
          ("tips_retrieval", "tips and retrieval"), ("old_logprobs", "old log-probs"), ("update", "update"),
          ("weight_sync", "weight sync"), ("validation", "validation"), ("checkpoint", "checkpoint"))


class PhaseTimes:
    """Seconds this process spent in each of PHASES, summed over the run, from `start` (a `time.perf_counter()`
    value: when the run began)."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.totals = dict.fromkeys((key for key, _ in PHASES), 0.0)

    def add(self, **seconds: float) -> dict[str, float]:
        """Count `phase=seconds` into the totals; returns them as the `time/<phase>_s` metrics of an iteration."""
        for phase, s in seconds.items():
            self.totals[phase] += s
        return {f"time/{phase}_s": s for phase, s in seconds.items()}

    def since(self, phase: str, t0: float) -> dict[str, float]:
        """`add(phase=now - t0)`."""
        return self.add(**{phase: time.perf_counter() - t0})

    def report(self) -> dict:
        """`{"wall_s", "phases_s", "other_s"}` from `start` to now: other is the wall time outside every phase
        (Lightning's own work, logging, the run's closing files), so the phases and other add up to the wall."""
        wall = time.perf_counter() - self.start
        return {"wall_s": wall, "phases_s": dict(self.totals), "other_s": wall - sum(self.totals.values())}


def phase_table(report: dict) -> list[str]:
    """The closing report's table of `PhaseTimes.report()`: each phase's total and its share of the wall time."""
    wall = report["wall_s"]
    rows = [(label, report["phases_s"][key]) for key, label in PHASES] + [("other", report["other_s"])]
    lines = [f"where the time went ({clock(wall)} wall):", f"  {'phase':<20} {'time':>7} {'share':>6}"]
    lines += [f"  {label:<20} {clock(s):>7} {100 * s / max(wall, 1e-9):5.1f}%" for label, s in rows]
    return lines


@dataclass
class Phase:
    """What the running iteration does, counted in its own unit (PHASE_UNITS). `listener` (the bar) hears
    every change; the counts move once per lock-step of the environments or per optimiser step, never per
    token."""

    name: str = ""
    done: int = 0
    total: int = 0
    iteration: int = 0  # 0-based; -1: the validation before training
    listener: Callable[[Phase], None] | None = None

    def set(self, name: str, done: int, total: int, iteration: int) -> None:
        self.name, self.done, self.total, self.iteration = name, done, total, iteration
        if self.listener is not None:
            self.listener(self)

    def advance(self) -> None:
        self.set(self.name, self.done + 1, self.total, self.iteration)

    def __str__(self) -> str:
        return f"{self.name} {self.done}/{self.total} {PHASE_UNITS[self.name]}" if self.name else ""


def clock(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m}:{s:02d}"


def eta(iteration: int, iterations: int, finished: int, elapsed: float, in_current: float | None = None) -> str:
    """Time left from the mean time of the `finished` iterations this process ran; `in_current`: seconds
    spent so far on iteration `iteration` (0-based, still running), None once it has finished."""
    spent = elapsed - (in_current or 0.0)
    if finished == 0:
        return "-:--"
    mean = spent / finished
    left = mean * (iterations - iteration - 1)
    if in_current is not None:
        left += max(mean - in_current, 0.0)
    return clock(left)


def stat_values(stats: dict, labels: tuple[str, ...] | None = None) -> list[tuple[str, str]]:
    """(label, formatted value) of the STATS in `stats`, only those `labels` when given."""
    return [(label, f"{stats[key]:{fmt}}") for key, label, fmt in STATS
            if key in stats and (labels is None or label in labels)]


def iteration_stats(history: list[dict], iteration: int | None = None) -> dict:
    """The numbers logged for `iteration` (rollouts and validation merged), by default the latest one logged."""
    stats: dict = {}
    for h in reversed(history):  # in iteration order: stop at the first earlier one
        iteration = h["iteration"] if iteration is None else iteration
        if h["iteration"] < iteration:
            break
        if h["iteration"] == iteration:
            stats = {**h, **stats}
    return stats


def eta_line(iteration: int, iterations: int, done_this_fit: int, elapsed: float, stats: dict) -> str:
    """`iteration 3/24  score 25.0  success 0.12  memory 40  elapsed 1:02  ETA 6:10` (1-based iteration;
    the ETA extrapolates the mean time of the iterations this process ran)."""
    return "  ".join([f"iteration {iteration + 1}/{iterations}", *(f"{k} {v}" for k, v in stat_values(stats)),
                      f"elapsed {clock(elapsed)}", f"ETA {eta(iteration, iterations, done_this_fit, elapsed)}"])


def bar_description(iterations: int, phase: Phase, finished: int, elapsed: float, in_current: float) -> str:
    """The bar's text while an iteration runs: `iteration 3/24  rollouts 5/16 episodes  elapsed 1:02  ETA 6:10`
    (`before training` for the validation that precedes the first iteration)."""
    it = phase.iteration
    where = f"iteration {it + 1}/{iterations}" if it >= 0 else "before training"
    left = eta(it, iterations, finished, elapsed, in_current) if it >= 0 else "-:--"
    return f"{where}  {phase}  elapsed {clock(elapsed)}  ETA {left}"


class IterationProgressBar(RichProgressBar):
    """Rich's bar with `iteration k/N` (1-based) and the phase's own count instead of `Epoch k/N-1` and
    Lightning's batch count, the latest score, success and memory size beside it, and a line per iteration."""

    def __init__(self, rollout):
        super().__init__(leave=True)
        self.rollout = rollout  # the RolloutCallback whose history holds each iteration's numbers
        rollout.phase.listener = self._show_phase
        self._t0: float | None = None
        self._epoch_t0 = 0.0
        self._done = 0
        self._opened_early = False  # the bar was opened before Lightning's first epoch start (see _show_phase)

    def _get_train_description(self, current_epoch: int) -> str:
        return f"iteration {current_epoch + 1}/{self.trainer.max_epochs}"

    def configure_columns(self, trainer) -> list:
        # the description carries the counts and times; Lightning's micro-batch count and speed would mislead
        return super().configure_columns(trainer)[:2]

    def get_metrics(self, trainer, pl_module) -> dict:
        return dict(stat_values(iteration_stats(self.rollout.history), BAR_STATS))

    def setup(self, trainer, pl_module, stage: str) -> None:
        from rich import get_console

        super().setup(trainer, pl_module, stage)
        if not get_console().is_terminal:  # a log file gets the plain lines only, not the bar's last frames
            self.disable()
        self._t0 = self._epoch_t0 = time.monotonic()
        self._done = 0

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if self._opened_early:  # the bar the validation before training or the first rollouts opened is this one
            self._opened_early = False
        else:
            super().on_train_epoch_start(trainer, pl_module)
            self._epoch_t0 = time.monotonic()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # the bar counts the phase (`_show_phase`), not Lightning's batches
        self._update_metrics(trainer, pl_module)
        self.refresh()

    def _show_phase(self, phase: Phase) -> None:
        if self.is_disabled or self._t0 is None:
            return
        if self.train_progress_bar_id is None:
            # Lightning fetches the first batch, and so plays the first rollouts, before it starts the bar
            self._init_progress(self.trainer)
            self.train_progress_bar_id = self._add_task(1, self._get_train_description(self.trainer.current_epoch))
            self._opened_early = True
        now = time.monotonic()
        text = bar_description(self.trainer.max_epochs, phase, self._done, now - self._t0, now - self._epoch_t0)
        self.progress.update(self.train_progress_bar_id, description=text, completed=phase.done,
                             total=max(phase.total, 1))
        self.refresh()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if not trainer.is_global_zero or self._t0 is None:
            return
        self._done += 1
        stats = iteration_stats(self.rollout.history, trainer.current_epoch)
        line = eta_line(trainer.current_epoch, trainer.max_epochs, self._done, time.monotonic() - self._t0, stats)
        if self._console is not None:
            self._console.print(line, soft_wrap=True, markup=False, highlight=False)
        else:
            print(line, flush=True)

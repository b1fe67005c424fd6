"""The console while a run trains: Lightning's rich bar, numbered as EMPO² iterations, plus one plain line
per iteration (readable in a log file or a non-terminal, where a live bar is not)."""

from __future__ import annotations

import time

from lightning.pytorch.callbacks import RichProgressBar


def eta_line(iteration: int, iterations: int, done_this_fit: int, elapsed: float, stats: dict) -> str:
    """`iteration 3/24  score 25.0  success 0.12  memory 40  elapsed 1:02  ETA 6:10` (1-based iteration;
    the ETA extrapolates the mean time of the iterations this process ran)."""
    def clock(seconds: float) -> str:
        m, s = divmod(int(round(seconds)), 60)
        return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m}:{s:02d}"

    remaining = iterations - iteration - 1
    eta = elapsed / max(done_this_fit, 1) * remaining
    parts = [f"iteration {iteration + 1}/{iterations}"]
    for key, label, fmt in (("rollout/score", "score", ".1f"), ("rollout/success", "success", ".2f"),
                            ("rollout/score_memory", "with tips", ".1f"), ("rollout/score_tipfree", "tip-free", ".1f"),
                            ("val/score_nomem", "val", ".1f"), ("memory/size", "memory", ".0f")):
        if key in stats:
            parts.append(f"{label} {stats[key]:{fmt}}")
    parts += [f"elapsed {clock(elapsed)}", f"ETA {clock(eta)}"]
    return "  ".join(parts)


class IterationProgressBar(RichProgressBar):
    """Rich's bar with `iteration k/N` (1-based) instead of `Epoch k/N-1`, and a line per iteration."""

    def __init__(self, rollout):
        super().__init__(leave=True)
        self.rollout = rollout  # the RolloutCallback whose history holds each iteration's numbers
        self._t0: float | None = None
        self._done = 0

    def _get_train_description(self, current_epoch: int) -> str:
        return f"iteration {current_epoch + 1}/{self.trainer.max_epochs}"

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        self._t0, self._done = time.monotonic(), 0

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if not trainer.is_global_zero or self._t0 is None:
            return
        self._done += 1
        stats: dict = {}
        for h in self.rollout.history:  # this iteration's rollout and validation numbers
            if h.get("iteration") == trainer.current_epoch:
                stats.update(h)
        line = eta_line(trainer.current_epoch, trainer.max_epochs, self._done, time.monotonic() - self._t0, stats)
        if self._console is not None:
            self._console.print(line, soft_wrap=True, markup=False, highlight=False)
        else:
            print(line, flush=True)

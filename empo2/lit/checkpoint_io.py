"""Checkpoint files written atomically: a reader (a resume, `empo2 eval`) sees a whole checkpoint or none.

Lightning's own writer streams into the target through an fsspec transaction whose temp file may sit on
another filesystem and is never fsynced, so a kill or power loss can leave a truncated checkpoint in
place of the good one. Here the bytes go to a hidden temp file next to the target, are fsynced, and
the temp file is renamed over the target (atomic within one filesystem); a kill before the rename leaves
the previous checkpoint untouched plus a torn `.<name>.*.tmp` that resume ignores and removes.

`IterationCheckpoint` writes one such file per checkpointed iteration and makes `last.ckpt` a link to it:
one full write per checkpoint, not two.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from empo2.lit.progress import PhaseTimes
from empo2.utils import fsync_path, raise_pending_interrupt, uninterrupted
from empo2.utils.faults import maybe_fail

TMP_SUFFIX = ".tmp"
LAST = "last.ckpt"


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with uninterrupted():  # a Ctrl-C waits for the write to end: the report then names this checkpoint
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TMP_SUFFIX, dir=path.parent)
            try:
                with os.fdopen(fd, "wb") as f, _without_crc32():
                    torch.save(checkpoint, f)
                    f.flush()
                    os.fsync(f.fileno())
                maybe_fail("checkpoint", int(checkpoint.get("epoch", -1)))
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            fsync_path(path.parent)  # the rename itself must survive a power loss


@contextlib.contextmanager
def _without_crc32():
    """`torch.save` without the CRC32 of every record: `torch.load` never checks them (a flipped byte loads
    silently either way), and computing them took most of a checkpoint write (docs/performance.md). Whole
    files are what the atomic rename guarantees; the caller's setting is restored."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def remove_torn_writes(ckpt_dir: Path) -> list[Path]:
    """Delete temp files of checkpoint writes that were killed before their rename; returns them."""
    torn = sorted(ckpt_dir.glob(f".*.ckpt.*{TMP_SUFFIX}"))
    for path in torn:
        path.unlink(missing_ok=True)
    return torn


def point_link(link: Path, target_name: str) -> None:
    """Make `link` a relative symlink to `target_name` in its folder, atomically: a new link is renamed over
    the old one, so a kill leaves the old link or the new one, never none. Relative, so a moved or copied
    run folder keeps a working link."""
    tmp = link.with_name(f".{link.name}.{os.getpid()}{TMP_SUFFIX}")  # a leftover is a torn write: removed on resume
    tmp.unlink(missing_ok=True)
    os.symlink(target_name, tmp)
    os.replace(tmp, link)
    fsync_path(link.parent)


class IterationCheckpoint(Checkpoint):
    """After every `every`-th iteration, the whole training state to `iter-epoch=NNNN.ckpt` (kept: the run's
    history), then `last.ckpt` pointed at it. `last.ckpt` is a symlink rather than a second copy of the same
    bytes (weights and optimiser state: gigabytes and seconds per iteration for a real model); resume reads
    the files themselves (`train.checkpoint_files`), so a link whose target was set aside as unreadable is
    never tried.

    A `Checkpoint` subclass, so Lightning calls it after every other callback's and the module's epoch-end
    hook: the state it saves is the finished iteration's. Unlike ModelCheckpoint it also saves iterations
    that took no optimiser step (a memory-only agent's: its state is the tip memory).
    """

    def __init__(self, dirpath: Path, every: int, times: PhaseTimes | None = None):
        self.dirpath, self.every = Path(dirpath), every
        self.times = times  # counts each save as the run's checkpoint phase, MLflow's time/checkpoint_s

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        iteration = trainer.current_epoch
        if (iteration + 1) % self.every == 0:
            self._save(trainer, iteration)
        raise_pending_interrupt()  # the iteration is done: a Ctrl-C a finalizer swallowed stops the run here

    def _save(self, trainer, iteration: int) -> None:
        path = self.dirpath / f"iter-epoch={iteration:04d}.ckpt"  # the name Lightning's ModelCheckpoint gave them
        t0 = time.perf_counter()
        # every rank takes part (sharded strategies gather), rank 0 writes; the full state: optimiser, callbacks
        trainer.save_checkpoint(path, weights_only=False)
        if trainer.is_global_zero:
            point_link(self.dirpath / LAST, path.name)
        if self.times is not None:
            metrics = self.times.since("checkpoint", t0)
            if trainer.logger is not None and trainer.is_global_zero:
                trainer.logger.log_metrics(metrics, step=iteration)

"""Checkpoint files written atomically: a reader (a resume, `empo2 eval`) sees a whole checkpoint or none.

Lightning's own writer streams into the target through an fsspec transaction whose temp file may sit on
another filesystem and is never fsynced, so a kill or power loss can leave a truncated `last.ckpt` in
place of the good one. Here the bytes go to a hidden temp file next to the target, are fsynced, and
the temp file is renamed over the target (atomic within one filesystem); a kill before the rename leaves
the previous checkpoint untouched plus a torn `.<name>.*.tmp` that resume ignores and removes.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from empo2.faults import maybe_fail
from empo2.utils import uninterrupted

TMP_SUFFIX = ".tmp"


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with uninterrupted():  # a Ctrl-C waits for the write to end: the report then names this checkpoint
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TMP_SUFFIX, dir=path.parent)
            try:
                with os.fdopen(fd, "wb") as f:
                    torch.save(checkpoint, f)
                    f.flush()
                    os.fsync(f.fileno())
                maybe_fail("checkpoint", int(checkpoint.get("epoch", -1)))
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            dir_fd = os.open(path.parent, os.O_RDONLY)  # the rename itself must survive a power loss
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)


def remove_torn_writes(ckpt_dir: Path) -> list[Path]:
    """Delete temp files of checkpoint writes that were killed before their rename; returns them."""
    torn = sorted(ckpt_dir.glob(f".*.ckpt.*{TMP_SUFFIX}"))
    for path in torn:
        path.unlink(missing_ok=True)
    return torn

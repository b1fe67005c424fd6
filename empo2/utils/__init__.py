"""Small shared helpers, at the bottom of the layers with `empo2.algo`: atomic file writes, seeding, run folders, the
cache folder, a quiet console, the peak memory of a process tree (here); the errors the CLI turns into one line or
an exit status (`errors`); fault injection for the kill tests (`faults`). Imports nothing of empo2 above it."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import json
import logging
import os
import random
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a folder (a folder's fsync makes a rename inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write to a temp file in the same folder, fsync, then rename: readers see the old or the new file,
    never a half-written one (a rename within one filesystem is atomic)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=2, sort_keys=True, default=str).encode())


def cache_root() -> Path:
    """`$EMPO2_CACHE`, default `~/.cache/empo2`: converted models, environment catalogues, games."""
    return Path(os.environ.get("EMPO2_CACHE") or Path.home() / ".cache" / "empo2")


def seed_everything(seed: int) -> None:
    import torch  # here, so the file helpers above stay importable without loading torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def make_run_dir(run_root: str, run_name: str | None) -> Path:
    """`<run_root>/<run_name>`, reused if it exists (that is how resume finds it); without a name, a new
    `<timestamp>` folder, suffixed `-2`, `-3`, ... when runs start within the same second, so a run never
    writes into another's folder."""
    root = Path(run_root).expanduser()
    if run_name:
        (root / run_name).mkdir(parents=True, exist_ok=True)
        return root / run_name
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = root / stamp, 1
    while True:
        try:
            path.mkdir()  # atomic claim: two processes starting together cannot both get this name
            return path
        except FileExistsError:
            n += 1
            path = root / f"{stamp}-{n}"


def plural(n: int, word: str) -> str:
    """`1 episode`, `2 episodes`: counts in console lines."""
    return f"{n} {word}" + ("" if n == 1 else "s")


# Ctrl-C held back while a block that must not be cut in half runs (a checkpoint write): a SIGINT handler
# that raises would otherwise leave torch.save's zip writer half-written and its error would replace the
# interrupt.
_critical_depth = 0
_held_interrupt: Callable[[], None] | None = None


@contextlib.contextmanager
def uninterrupted():
    """Run a block to its end even if Ctrl-C comes: a handler that `hold_interrupt`s during it runs after it."""
    global _critical_depth, _held_interrupt
    _critical_depth += 1
    try:
        yield
    except BaseException:
        _critical_depth -= 1
        if _critical_depth == 0:  # the block's own error stops the run; it is not replaced by the interrupt
            _held_interrupt = None
        raise
    _critical_depth -= 1
    if _critical_depth == 0 and _held_interrupt is not None:
        act, _held_interrupt = _held_interrupt, None
        act()


# A Ctrl-C whose exception Python swallows (raised while a finalizer, `__del__`, runs: printed as "Exception
# ignored" and dropped) would otherwise be lost and the run would go on to its end: the handler records it, and
# `raise_pending_interrupt` raises it again where an iteration ends.
_pending_interrupt: BaseException | None = None


def record_interrupt(error: BaseException | None) -> None:
    """For a signal handler: the error it is about to raise (None forgets a recorded one)."""
    global _pending_interrupt
    _pending_interrupt = error


def raise_pending_interrupt() -> None:
    """Raise a recorded interrupt that never reached the run (see `record_interrupt`)."""
    global _pending_interrupt
    if _pending_interrupt is not None:
        error, _pending_interrupt = _pending_interrupt, None
        raise error


def hold_interrupt(act: Callable[[], None]) -> bool:
    """For a signal handler: inside an `uninterrupted` block, keep `act` for the block's end and return True."""
    global _held_interrupt
    if _critical_depth:
        _held_interrupt = act
        return True
    return False


def release_free_memory() -> None:
    """Return the memory glibc's allocator holds free to the OS (`malloc_trim(0)`: also whole free pages inside
    its heaps, not only at their top). Does nothing with another C library."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    return getattr(ctypes.CDLL(ctypes.util.find_library("c")), "malloc_trim", None)


# A training process's start-up (torch, transformers and Lightning imported; the model, the engine and the
# environments built) creates about a million objects that live as long as the process. Python's cyclic collector
# scans the older ones again each time enough new ones pile up: 1.2 of the 6 CPU-s `import lightning` takes here. So
# the entry points of such a process (`empo2 train`, a sweep trial) pause it, and at the first rollout everything
# the start-up built is frozen (not scanned again while it lives, as vLLM freezes its engine's) and the collector
# runs again. The start-up's garbage (a few MB of cycles) is frozen with it: a collection to free it first cost
# 0.45 CPU-s of a tiny run. train() called from a long-lived process (a notebook, a test) leaves the collector
# alone: there the frozen set would be everything the caller holds, its garbage too, for the whole run.
_gc_paused = False  # pause_gc_for_startup turned the collector off, and the start-up has not settled yet
_gc_froze = False  # settle_startup_heap froze the start-up's objects


def pause_gc_for_startup() -> None:
    """Turn the cyclic collector off until `settle_startup_heap` (a run's first rollout) or `thaw_startup_heap`;
    left alone where a caller turned it off."""
    global _gc_paused
    if gc.isenabled():
        gc.disable()
        _gc_paused = True


def settle_startup_heap() -> None:
    """The start-up is over: freeze what it built and turn the collector on again. Does nothing unless
    `pause_gc_for_startup` paused it."""
    global _gc_paused, _gc_froze
    if _gc_paused:
        gc.freeze()
        gc.enable()
        _gc_paused, _gc_froze = False, True


def thaw_startup_heap() -> None:
    """At the end of the entry point: the frozen objects go back to the collector, so the interpreter's exit frees
    them (libraries check at their exit that nothing of theirs is left; triton's nanobind modules print every object
    left), and a start-up that never settled (it failed) turns the collector on again."""
    global _gc_paused, _gc_froze
    if _gc_froze:
        gc.unfreeze()
        _gc_froze = False
    if _gc_paused:
        gc.enable()
        _gc_paused = False


def quiet_libraries() -> None:
    """Library chatter off at its source: Lightning's INFO lines (accelerator banner, adverts, "`max_epochs`
    reached") and its own deprecation notices, transformers' info and weight-loading bars, MLflow's INFO, vLLM's
    INFO and warnings.
    Their other warnings and errors stay."""
    # Lightning resets the level of `lightning.pytorch` when imported; its INFO lines come from the
    # rank_zero child loggers, whose level it leaves alone
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero", "mlflow",
                 "alembic", "transformers", "sentence_transformers", "httpx"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")  # Lightning on torch 2.13
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")  # resume
    # per-iteration means are logged from rank 0 by design; with engine=vllm the process group vLLM opens for
    # itself (one process) makes Lightning say this of every metric
    warnings.filterwarnings("ignore", message=r"It is recommended to use `self.log\(.*sync_dist=True")
    # Lightning says this on any machine with SLURM's `srun` on PATH (a cluster's login and compute nodes) and
    # nothing is wrong: a local run needs no srun, and `--launcher slurm` starts multi-task jobs with srun itself
    warnings.filterwarnings("ignore", message=r"The `srun` command is available on your system but is not used")
    # vLLM (engine=vllm): its logger is configured from this when first imported; its import-time deprecation
    # notices; and the CPU build's NUMA-binding notice, a C++ warning that only torch's C++ log level reaches
    # (read when torch is first imported, which has not happened yet)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    logging.getLogger("vllm").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def tree_rss_bytes(pid: int | None = None) -> int:
    """Resident memory of a process and all its descendants (ScienceWorld's JVMs, engine workers), summed, in bytes;
    0 where /proc cannot be read. Pages two processes share count twice."""
    parent, rss = {}, {}
    try:
        entries = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return 0
    for name in entries:
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:  # ended since the listing
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after the command name, which may hold spaces
        parent[int(name)], rss[int(name)] = int(fields[1]), int(fields[21])
    children: dict[int, list[int]] = {}
    for child, ppid in parent.items():
        children.setdefault(ppid, []).append(child)
    todo, pages = [pid or os.getpid()], 0
    while todo:
        p = todo.pop()
        pages += rss.get(p, 0)
        todo += children.get(p, [])
    return pages * os.sysconf("SC_PAGE_SIZE")


class PeakMemory:
    """The peak resident memory of this process and its descendants between `start()` and `stop()`: the largest
    `tree_rss_bytes` a background thread saw, sampling every `interval` seconds (a shorter spike can fall between
    two samples), and never below this process's own exact peak (`ru_maxrss`)."""

    def __init__(self, interval: float = 1.0) -> None:
        self.interval, self.peak = interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="empo2-peak-memory", daemon=True)

    def start(self) -> PeakMemory:
        self._thread.start()
        return self

    def stop(self) -> float:
        """Stop sampling; the peak in GiB."""
        import resource

        self._stop.set()
        self._thread.join()
        own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        return max(self.peak, own, tree_rss_bytes()) / 2**30

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, tree_rss_bytes())
            if self._stop.wait(self.interval):
                return

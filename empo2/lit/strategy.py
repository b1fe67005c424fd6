"""The Lightning strategy for a trainer config: `fsdp` shards the policy with FSDP2 (`fully_shard`), one unit per
decoder layer plus the root, on GPUs (NCCL) or CPUs (gloo); every other strategy passes through by name.

Under FSDP2 the module keeps its class and names; its parameters become DTensor shards, gathered by forward hooks
(one layer at a time) and reduce-scattered in backward. Checkpoints hold one full state dict, in the layout every
other strategy writes (parameter names, optimizer state keyed by the optimizer's parameter order): a checkpoint moves
between fsdp on any number of processes, ddp, a single process and `empo2 eval`.

`export_ranks` writes a process's ranks into its environment the way torchrun would, for every launcher.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from empo2.config import TrainConfig


def decoder_layer_classes(model) -> set[type]:
    """The transformer block classes of a Hugging Face model (its `_no_split_modules`), found among its
    submodules: FSDP shards each block as one unit, so a forward gathers one layer's weights at a time."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not classes:
        raise ValueError(f"{type(model).__name__} names no decoder layer class (_no_split_modules); FSDP needs one "
                         f"to shard on")
    return classes


def hf_model(policy):
    """The Hugging Face model of a policy: inside a peft wrapper, the wrapped model. Every call of the policy,
    `generate` included (peft sends it straight to the wrapped model), goes through this module's forward."""
    return policy.get_base_model() if hasattr(policy, "peft_config") else policy


def shard_policy(policy, mesh, mp_policy: MixedPrecisionPolicy, frozen: bool = False) -> None:
    """FSDP2 on the policy, in place: each decoder layer one unit, then the Hugging Face model as the root unit
    (embeddings, final norm, LM head; tied weights stay one parameter). LoRA adapters are sharded with the layer
    they sit in; frozen and trainable parameters share units. Activation checkpointing, when on, is the model's own
    (`gradient_checkpointing_enable`): it recomputes inside each layer's call, where FSDP gathers the layer again.
    `frozen`: a model that never runs a backward (the KL reference), whose root is freed after each forward too."""
    root = hf_model(policy)
    layers = decoder_layer_classes(root)
    for module in root.modules():
        if type(module) in layers:
            # gathered for its forward, freed after it, gathered again for its backward: one layer's weights at a time
            fully_shard(module, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=True)
    # the backward starts with the LM head: the root stays gathered from its forward to its backward
    fully_shard(root, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=frozen)


def float32_master_weights(policy, frozen: bool = False) -> None:
    """The trainable parameters in float32, in place, whatever dtype the weights were read in (`model.dtype`);
    `frozen=True` converts every parameter (the KL reference: see `EMPO2Module.configure_model`).

    AdamW keeps its state in its parameters' dtype, and a bfloat16 weight (8 significant bits) drops any update
    smaller than about 2^-9 of itself: at lr 1e-6 nearly every one. So the weights that train, and their optimizer
    state, are float32, and bfloat16 is a compute choice (autocast, FSDP2's `MixedPrecisionPolicy`), as in verl and
    TRL. Frozen parameters (a LoRA base) keep the dtype they were read in; so do buffers. Under FSDP2 it runs after
    `shard_policy`, on the DTensor shards (FSDP2 re-registers each converted shard), so no rank ever holds the whole
    model in float32. Idempotent: nothing happens when every trainable parameter is float32 already."""
    def converted(t: torch.Tensor) -> bool:  # `_apply` hands over each parameter itself: requires_grad is there
        return t.is_floating_point() and (t.requires_grad or (frozen and isinstance(t, torch.nn.Parameter)))

    def upcast(t: torch.Tensor) -> torch.Tensor:
        return t.float() if converted(t) else t

    if all(p.dtype == torch.float32 for p in policy.parameters() if converted(p)):
        return
    with torch.no_grad():
        # `_apply` rather than `.data =` per parameter: it is the conversion FSDP2 supports on sharded modules
        # (`FSDPModule._apply` reshards, then re-pads and re-registers every converted shard)
        policy._apply(upcast)


def is_sharded(module) -> bool:
    return any(isinstance(m, FSDPModule) for m in module.modules())


def reshard(module) -> None:
    """Every FSDP2 unit in `module` sharded again: after forwards without a backward (no_grad) the root, which
    keeps its weights gathered for the backward, would hold them until the next training step."""
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


@contextlib.contextmanager
def unsharded(module):
    """The full weights of every FSDP2 unit in `module` for the duration, for the HF engine's generation (rollouts,
    tips, validation), whose number of forwards differs between ranks. Each unit is gathered once on entry (every
    rank, same order) and kept gathered: a forward then issues no collective. On exit the units are sharded again
    and get back `shard_policy`'s plan (the root kept gathered after its forward, the layers not). Nothing happens
    for a module without FSDP units."""
    units = [m for m in module.modules() if isinstance(m, FSDPModule)]  # pre-order: the root first
    if not units:
        yield
        return
    root = units[0]
    # FSDP2 takes the first unit to run a forward for the root, and the HF engine's prefill calls the decoder, and so
    # its layers, without the model's forward: name the root before any of that (idempotent)
    root._get_fsdp_state()._lazy_init()
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(unit is not root, recurse=False)


class FSDP2Strategy(ModelParallelStrategy):
    """Lightning's FSDP2 strategy with data parallelism only: one mesh dimension over all processes of all nodes.

    Lightning calls `EMPO2Module.configure_model` after the process group is up, which calls `shard`. Mixed
    precision (`bf16-mixed`) on a GPU also gathers the weights in bfloat16 (`MixedPrecisionPolicy`; gradients are
    reduced in float32); on a CPU the weights stay float32."""

    def __init__(self, mixed_precision: bool):
        super().__init__(save_distributed_checkpoint=False)
        self.mixed_precision = mixed_precision

    def setup_environment(self) -> None:
        # before Lightning builds the (data parallel, tensor parallel) mesh: every process shards, none splits tensors
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()

    def shard(self, policy, frozen: bool = False) -> None:
        """`shard_policy` on this run's mesh and mixed precision (`frozen`: the KL reference)."""
        if is_sharded(policy):  # configure_model runs again for every fit of the same module
            return
        bf16 = self.mixed_precision and self.root_device.type == "cuda"
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else \
            MixedPrecisionPolicy()
        shard_policy(policy, self.device_mesh["data_parallel"], mp, frozen)

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        """The full optimizer state on rank 0 (empty elsewhere), keyed as `torch.optim` keys it: by the parameter's
        place in the optimizer (Lightning's own keys by the place in the module, which differs under LoRA)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps it
        state = get_optimizer_state_dict(self.model, optimizer,
                                         options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not state:  # not rank 0
            return state
        return _rekeyed(state, {name: i for i, name in enumerate(_optimizer_names(self.model, optimizer))})

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """A full checkpoint (written by this strategy on any number of processes, or by any other strategy) into
        the sharded module and optimizer: rank 0's tensors are broadcast, each rank keeps its shard."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        path = Path(self.broadcast(checkpoint_path))
        checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                   strict=self.lightning_module.strict_loading)
        set_model_state_dict(self.model, checkpoint.pop("state_dict"), options=options)
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            named = _rekeyed(state, dict(enumerate(_optimizer_names(self.model, optimizer))))
            set_optimizer_state_dict(self.model, optimizer, named, options=options)
        return checkpoint


def _optimizer_names(model, optimizer) -> list[str]:
    """The name of each parameter the optimizer holds, in the optimizer's order (a tied parameter under its first
    name, as the state dicts name it)."""
    names: dict[torch.nn.Parameter, str] = {}
    for name, param in model.named_parameters():
        names.setdefault(param, name)
    return [names[p] for group in optimizer.param_groups for p in group["params"]]


def _rekeyed(state: dict[str, Any], keys: dict) -> dict[str, Any]:
    """An optimizer state dict with its parameter keys mapped through `keys` (names <-> torch.optim's indices)."""
    return {"state": {keys[k]: v for k, v in state["state"].items()},
            "param_groups": [dict(g, params=[keys[k] for k in g["params"]]) for g in state["param_groups"]]}


def build_strategy(cfg: TrainConfig, model):
    """A strategy object for `fsdp`; Lightning's own name otherwise. `model` is the policy before sharding: a
    decoder layer class must be found now, not after the processes have started."""
    if cfg.trainer.strategy != "fsdp":
        return cfg.trainer.strategy
    decoder_layer_classes(hf_model(model))
    return FSDP2Strategy(mixed_precision=cfg.trainer.precision == "bf16-mixed")


def export_ranks(trainer) -> None:
    """This process's place in a multi-process run, in the variables a process torchrun starts has (RANK,
    LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), taken from the trainer once its process group is up, whatever
    started the process: Lightning's own launcher sets no RANK, and under srun Lightning reads SLURM_PROCID and
    SLURM_LOCALID and sets none of the first three. vLLM's `external_launcher` executor reads RANK and LOCAL_RANK
    (and would open its group from the others); the CLI reads RANK after the run. A one-process run sets nothing."""
    if trainer.world_size == 1:
        return
    cluster = trainer.strategy.cluster_environment
    os.environ.update(RANK=str(trainer.global_rank), LOCAL_RANK=str(trainer.local_rank),
                      WORLD_SIZE=str(trainer.world_size), MASTER_ADDR=cluster.main_address,
                      MASTER_PORT=str(cluster.main_port))

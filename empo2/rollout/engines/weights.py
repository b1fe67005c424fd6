"""Full, LoRA-merged policy weights under their Hugging Face names, for an engine with its own copy.

A sharded (FSDP) policy is gathered; a peft-wrapped one has each adapter folded into its base weight,
W' = W + scaling * B @ A, layer by layer (a `merge_and_unload` on a copy of a 7B model would need a
second full model in memory). Tensors are yielded one at a time so a consumer that copies them
(vLLM's `load_weights`) never needs the whole gathered model at once under FSDP2.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

# Name parts that wrappers (FSDP1, activation checkpointing, torch.compile) insert into parameter names.
_WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
_PEFT_PREFIX = "base_model.model."


@dataclass
class _LoraLayer:
    adapters: list[tuple[str, float]]  # (adapter name, scaling) of the adapters to fold in
    fan_in_fan_out: bool  # the base weight is stored (in, out), as in GPT-2's Conv1D


def _clean(name: str) -> str:
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def _lora_layers(module: nn.Module) -> dict[str, _LoraLayer]:
    """LoRA layers by cleaned module name, with what merging each one needs."""
    layers = {}
    for name, sub in module.named_modules():
        if not (hasattr(sub, "lora_A") and hasattr(sub, "scaling") and hasattr(sub, "base_layer")):
            continue
        if len(getattr(sub, "lora_embedding_A", ())) or any(getattr(sub, "use_dora", {}).values()) \
                or any((getattr(sub, "lora_bias", None) or {}).values()):
            raise NotImplementedError(f"{name}: only plain LoRA on linear layers can be merged for the engine "
                                      "(not embedding LoRA, DoRA or LoRA bias)")
        adapters = [] if sub.disable_adapters else [
            (a, float(sub.scaling[a])) for a in sub.active_adapters
            if a in sub.lora_A and a not in sub.merged_adapters]  # merged ones are already inside W
        layers[_clean(name)] = _LoraLayer(adapters, bool(getattr(sub, "fan_in_fan_out", False)))
    return layers


def _state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """Full tensors for FSDP1 (gathered here), DTensor shards for FSDP2 (gathered one by one later)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # Every rank gets the full tensors: each rank feeds its own colocated engine.
        return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    return module.state_dict()


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


@torch.no_grad()
def full_named_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every entry of the policy's state dict, LoRA merged, peft prefixes removed.

    The names are those of the plain Hugging Face model (`model.layers.0.self_attn.q_proj.weight`), which
    is what vLLM's `load_weights` maps. Under FSDP every rank must iterate the whole generator (the
    gathers are collectives).
    """
    lora = _lora_layers(module)
    state = {_clean(k): v for k, v in _state_dict(module).items()}
    strip = _PEFT_PREFIX if hasattr(module, "peft_config") else ""
    for name, value in state.items():
        if ".modules_to_save." in name or ".original_module." in name:
            raise NotImplementedError(f"{name}: peft modules_to_save cannot be merged for the engine")
        parts = name.split(".")
        if len(parts) > 3 and parts[-3] in ("lora_A", "lora_B") and ".".join(parts[:-3]) in lora:
            continue  # folded into its base weight below
        if "base_layer" in parts:
            i = parts.index("base_layer")
            layer_name = ".".join(parts[:i])
            if layer_name in lora:
                name = ".".join(parts[:i] + parts[i + 1:])
                if parts[i + 1:] == ["weight"]:
                    value = _merged_weight(_full(value), state, layer_name, lora[layer_name])
        yield name.removeprefix(strip), _full(value)


def _merged_weight(weight: torch.Tensor, state: dict[str, torch.Tensor], layer_name: str,
                   layer: _LoraLayer) -> torch.Tensor:
    """W + sum over adapters of scaling * B @ A, computed in float32, returned in W's dtype."""
    if not layer.adapters:
        return weight
    merged = weight.float()  # (out, in), or (in, out) when fan_in_fan_out
    for adapter, scaling in layer.adapters:
        a = _full(state[f"{layer_name}.lora_A.{adapter}.weight"]).float()  # (r, in)
        b = _full(state[f"{layer_name}.lora_B.{adapter}.weight"]).float()  # (out, r)
        delta = (b @ a) * scaling  # (out, in)
        merged = merged + (delta.T if layer.fan_in_fan_out else delta)
    return merged.to(weight.dtype)

"""The Lightning strategy for a trainer config: the `fsdp` preset shards on the policy's decoder layers."""

from __future__ import annotations

from empo2.config import TrainConfig


def decoder_layer_classes(model) -> set[type]:
    """The transformer block classes of a Hugging Face model (its `_no_split_modules`), found among its
    submodules: FSDP wraps each block as one unit, so a forward gathers one layer's weights at a time."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not classes:
        raise ValueError(f"{type(model).__name__} names no decoder layer class (_no_split_modules); FSDP needs one "
                         f"to wrap")
    return classes


def build_strategy(cfg: TrainConfig, model):
    """A strategy object for `fsdp` (auto-wrap on decoder layers, activation checkpointing when
    `model.gradient_checkpointing`, full state dicts in checkpoints); Lightning's own name otherwise."""
    if cfg.trainer.strategy != "fsdp":
        return cfg.trainer.strategy
    from lightning.pytorch.strategies import FSDPStrategy

    layers = decoder_layer_classes(model)
    return FSDPStrategy(
        auto_wrap_policy=layers,
        activation_checkpointing_policy=layers if cfg.model.gradient_checkpointing else None,
        state_dict_type="full",  # one file, loadable on any number of GPUs and by `empo2 eval`
        use_orig_params=True,  # LoRA: frozen and trainable parameters share FSDP units
        limit_all_gathers=True,
    )

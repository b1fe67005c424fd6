"""Rollouts: prompt building, generation engines (HF, vLLM), the per-call collection spec and the worker that
plays the environments.

The package owns one collection from the config to the samples: `CollectionSpec` (frozen, built per call),
`RolloutWorker` (engine, environments, tip memory, novelty counter; `state_dict`), prompts, the engines and their
weight sync. May import `empo2.models`, `empo2.memory`, `empo2.envs`, `empo2.config`, `empo2.algo` and
`empo2.utils`; `empo2.lit` and `empo2.workflows` sit above it."""

from empo2.rollout.engines import (
    Generation,
    GenerationEngine,
    HFEngine,
    SamplingParams,
    VLLMEngine,
    build_engine,
    full_named_tensors,
)
from empo2.rollout.prompts import DEFAULT_SYSTEM_PROMPT, ChatTemplateError, Prompt, PromptBuilder

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "ChatTemplateError",
    "Generation",
    "GenerationEngine",
    "HFEngine",
    "Prompt",
    "PromptBuilder",
    "SamplingParams",
    "VLLMEngine",
    "build_engine",
    "full_named_tensors",
]

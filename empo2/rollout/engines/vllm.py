"""Generation with a vLLM engine colocated in the training process (GPU only).

The engine keeps its own copy of the weights, refreshed after every optimiser step with
`update_weights(full_named_tensors(policy))`, which hands the tensors to the in-process vLLM model's
`load_weights` (the route verl and TRL's colocate mode take). The model must live in this process:
the engine turns vLLM's V1 engine-core subprocess off, and under torch.distributed every rank runs its
own engine through vLLM's `external_launcher` executor.

With sleep_mode the engine can hand its memory back during updates: `sleep()` offloads the weights
to CPU and drops the KV cache; `update_weights` wakes only the weights before loading (waking the KV
cache as well would need both at once); the next `generate` wakes the KV cache.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Iterable

import torch
from transformers import AutoConfig, GenerationConfig

from empo2.rollout.engines.base import Generation, SamplingParams, StopTokens, eos_ids

INSTALL_HINT = "VLLMEngine needs vllm: run `pip install -e .[vllm]` on a GPU machine"
# Where the in-process model sits, newest vLLM first.
_MODEL_PATHS = (
    "model_executor.driver_worker.worker.model_runner.model",
    "engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model",
    "model_executor.driver_worker.model_runner.model",
)


def _import_vllm():
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    return vllm


def _checkpoint_generation_config(model_path: str):
    """The checkpoint's generation config (it may list extra EOS ids), or None when it ships none."""
    try:
        return GenerationConfig.from_pretrained(model_path)
    except OSError:
        return None


def _request_seed(seed: int, index: int) -> int:
    """Distinct per-request seeds: seed s's request 1 must not replay seed s+1's request 0."""
    return (seed * 1_000_003 + index) % (2**63 - 1)


class VLLMEngine:
    """vllm.LLM in this process, fed and read as token ids; responses follow the same stop rules as HFEngine.

    llm_kwargs: further `vllm.LLM` arguments (max_model_len, enforce_eager, ...).
    """

    def __init__(self, model_path: str, tokenizer, gpu_memory_utilization: float = 0.3,
                 tensor_parallel_size: int = 1, sleep_mode: bool = False, dtype: str = "bfloat16", seed: int = 0,
                 llm_kwargs: dict | None = None):
        # vLLM reads this when it builds its engine: the model has to stay in this process for load_weights.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        vllm = _import_vllm()
        kwargs = dict(llm_kwargs or {})
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
            # Ranks of one tensor-parallel group must sample alike; different groups must not.
            seed += dist.get_rank() // tensor_parallel_size
        self.sleep_mode = sleep_mode
        self.llm = vllm.LLM(model=str(model_path), tokenizer=str(model_path), dtype=dtype, seed=seed,
                            gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=tensor_parallel_size,
                            enable_sleep_mode=sleep_mode, enable_prefix_caching=True, **kwargs)
        self._vllm = vllm
        self._model = self._in_process_model()
        self.stops = StopTokens(tokenizer, eos_ids(tokenizer, _checkpoint_generation_config(model_path)),
                                AutoConfig.from_pretrained(model_path).vocab_size)
        self._asleep: set[str] = set()  # memory tags currently released ("weights", "kv_cache")

    def _in_process_model(self):
        engine = self.llm.llm_engine
        for path in _MODEL_PATHS:
            try:
                return functools.reduce(getattr, path.split("."), engine)
            except AttributeError:
                continue
        raise RuntimeError("the vLLM model does not live in this process, so its weights cannot be updated: set "
                           "VLLM_ENABLE_V1_MULTIPROCESSING=0 before vllm is first imported")

    # ---------------------------------------------------------------------------------------- generate
    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None) -> list[Generation]:
        if not prompts:
            return []
        self.wake_up()
        stop_ids = sorted(self.stops.stop_ids(params.stop_at_newline))
        sampling = [self._vllm.SamplingParams(
            n=1, temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_new_tokens,
            stop_token_ids=stop_ids, detokenize=False,
            seed=None if seed is None or params.temperature == 0 else _request_seed(seed, i))
            for i in range(len(prompts))]
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sampling_params=sampling,
                                    use_tqdm=False)
        # vLLM appends the stop token to token_ids; finish() cuts there too, so both engines agree exactly.
        return [self.stops.finish(list(out.outputs[0].token_ids), params) for out in outputs]

    # ----------------------------------------------------------------------------------------- weights
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy full tensors with Hugging Face names (see `full_named_tensors`) into the engine's model."""
        if "weights" in self._asleep:
            self._wake(["weights"])
        self._model.load_weights(weights=((name, tensor) for name, tensor in named_tensors))
        if "kv_cache" not in self._asleep:  # vLLM's sleep already forgot the cache
            self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

    # ---------------------------------------------------------------------------------- sleep and wake
    def sleep(self) -> None:
        """Offload the weights to CPU and drop the KV cache (only with sleep_mode; otherwise nothing)."""
        if self.sleep_mode and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = {"weights", "kv_cache"}

    def wake_up(self) -> None:
        """Bring back whatever `sleep` released."""
        if self._asleep:
            self._wake(sorted(self._asleep))

    def _wake(self, tags: list[str]) -> None:
        if "tags" in inspect.signature(self.llm.wake_up).parameters:
            self.llm.wake_up(tags=tags)
            self._asleep -= set(tags)
        else:  # vLLM without per-tag wake-up brings everything back at once
            self.llm.wake_up()
            self._asleep = set()

"""What every generation engine shares: sampling parameters, the result type, the protocol, and the
stop-token bookkeeping that turns raw sampled ids into a response.

A response keeps its stop token (EOS, or the first token whose text contains a newline) in
`token_ids`, so the trainer scores the decision to stop like any other token; `text` is the action
the environment sees: decoded without the stop token and stripped.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass
class SamplingParams:
    """temperature 0 means greedy decoding; top_p is the nucleus mass (1 keeps the whole distribution).
    logprobs: also return each response token's log-prob under softmax(logits / temperature): over the whole
    vocabulary with top_p 1 (the distribution the trainer scores); with top_p < 1 HF still reads the whole vocabulary,
    vLLM the nucleus it sampled from (renormalised).
    kind: what the responses are for, "action" or "tip"; sampling ignores it, `StopTokens.returned` records it."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 32
    stop_at_newline: bool = True
    logprobs: bool = False
    kind: str = "action"

    def __post_init__(self):
        if self.kind not in ("action", "tip"):
            raise ValueError(f"kind must be 'action' or 'tip', got {self.kind!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.logprobs and self.temperature == 0:
            raise ValueError("logprobs need a sampling temperature > 0 (greedy decoding has no distribution)")


@dataclass
class Generation:
    """token_ids: the sampled response, stop token included when there is one (at most max_new_tokens ids).
    text: the response without its stop token (cut at its first newline when stopping at newlines), stripped.
    finished: the response ended with a stop token (EOS, or a newline token when stopping at newlines)
    rather than running into max_new_tokens.
    logprobs: with `SamplingParams.logprobs`, one float32 log-prob per entry of token_ids; None otherwise."""

    token_ids: list[int]
    text: str
    finished: bool
    logprobs: list[float] | None = None


@runtime_checkable
class GenerationEngine(Protocol):
    # whether the engine generates with the policy module itself (then, under FSDP, the policy's weights must be
    # gathered while it generates) rather than with its own copy of the weights, loaded by `update_weights`
    generates_with_policy: bool

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seed: int | None = None) -> list[Generation]:
        """One response per prompt (token ids without padding), in prompt order. The same seed, prompts and
        params give the same responses; seed None draws from the process's random state."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the policy's current weights (full tensors, Hugging Face parameter names)."""
        ...

    def group_has_work(self, has_work: bool) -> bool:
        """Whether this process or any other that shares the engine with it (a tensor-parallel vLLM group) has work
        left. Such an engine generates for the group only when every member calls `generate`, so a caller whose
        own work has ended keeps calling it, with no prompts, while this says True."""
        ...


def eos_ids(tokenizer, generation_config=None) -> list[int]:
    """The tokenizer's EOS plus any EOS the checkpoint's generation config lists (Qwen ends turns with two)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    config_eos = getattr(generation_config, "eos_token_id", None)
    if config_eos is not None:
        ids |= set(config_eos) if isinstance(config_eos, (list, tuple)) else {config_eos}
    if not ids:
        raise ValueError("the tokenizer has no eos_token and the generation config names none")
    return sorted(ids)


class StopTokens:
    """EOS ids and the ids whose text contains a newline, precomputed once per tokenizer.

    vocab_size: the model's vocabulary size when it is larger than the tokenizer's (padded embeddings).
    returned: None, or after `keep_record()` every response `finish` gave out as (request kind, token ids), in
    order. Both engines hand out responses only through `finish`, so this is what the engine returned: a check
    of where a prompt's text came from can hold it against this (off by default: it grows with every call).
    """

    def __init__(self, tokenizer, eos: Iterable[int], vocab_size: int | None = None):
        self.tokenizer = tokenizer
        self.eos = frozenset(eos)
        self.size = max(len(tokenizer), vocab_size or 0)
        special = set(tokenizer.all_special_ids)
        # One batched decode of the whole vocabulary (docs/performance.md) instead of decoding per step.
        texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
        self.newline = frozenset(i for i, t in enumerate(texts) if "\n" in t and i not in special)
        self._tables: dict[torch.device, torch.Tensor] = {}
        self.returned: list[tuple[str, list[int]]] | None = None

    def keep_record(self) -> list[tuple[str, list[int]]]:
        """Starts (or restarts) `returned` and gives it."""
        self.returned = []
        return self.returned

    def stop_ids(self, stop_at_newline: bool) -> frozenset[int]:
        return self.eos | self.newline if stop_at_newline else self.eos

    def newline_table(self, device: torch.device) -> torch.Tensor:
        """(size,) bool: True at newline-bearing ids, for a per-step lookup on `device`."""
        table = self._tables.get(device)
        if table is None:
            table = torch.zeros(self.size, dtype=torch.bool)
            table[list(self.newline)] = True
            table = self._tables[device] = table.to(device)
        return table

    def finish(self, ids: Sequence[int], params: SamplingParams,
               logprobs: Sequence[float] | None = None) -> Generation:
        """Cuts raw sampled ids (and their log-probs, if given) after the first stop token (padding or overrun
        after it goes) and decodes."""
        ids = list(ids[:params.max_new_tokens])
        stops = self.stop_ids(params.stop_at_newline)
        end = next((j + 1 for j, t in enumerate(ids) if t in stops), None)
        finished = end is not None
        if finished:
            ids = ids[:end]
        body = ids[:-1] if finished and ids[-1] in self.eos else ids
        text = self.tokenizer.decode(body, skip_special_tokens=True)
        if params.stop_at_newline:
            text = text.split("\n", 1)[0]  # the newline token may carry text before its "\n" ("look.\n")
        kept = None if logprobs is None else list(logprobs[:len(ids)])
        if self.returned is not None:
            self.returned.append((params.kind, list(ids)))
        return Generation(token_ids=ids, text=text.strip(), finished=finished, logprobs=kept)

"""Generation with transformers' `generate` on the policy module itself.

The engine holds no copy of the weights, so the responses always come from the current policy and
`update_weights` has nothing to do. Works on a plain or a peft-wrapped causal LM.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.cache_utils import DynamicCache, DynamicLayer, StaticCache

from empo2.models.prefix_cache import PrefixCaches, cheapest_runs
from empo2.rollout.engines.base import Generation, SamplingParams, StopTokens, eos_ids


class _StopAtNewline(StoppingCriteria):
    """Per-row stop once the last sampled id is newline-bearing: one table lookup per step, no decoding."""

    def __init__(self, table: torch.Tensor):
        self.table = table  # (V,) bool

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        return self.table[input_ids[:, -1]]  # (B,)


class _TokenLogprobs:
    """Each sampled token's log-prob under softmax(logits / temperature), gathered during `generate`.

    `generate` runs its processors on the step's raw float32 logits (before its own temperature and top-p
    warpers), samples, appends the token, then asks the stopping criteria: the processor keeps the step's
    log-softmax, the criterion picks the sampled token's entry, so only one (B, V) table lives at a time.
    """

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.steps: list[torch.Tensor] = []  # per generated position, (B,) float32
        self._logp: torch.Tensor | None = None  # (B, V) of the step in flight
        self.processor, self.criterion = _Keep(self), _Gather(self)

    def rows(self) -> list[list[float]]:
        return torch.stack(self.steps, 1).tolist() if self.steps else []  # (B, T)


class _Keep(LogitsProcessor):
    def __init__(self, rec: _TokenLogprobs):
        self.rec = rec

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        # the trainer's arithmetic (`EMPO2Module.response_logprobs`): float32 logits / T, then log-softmax
        self.rec._logp = torch.log_softmax(scores.float() / self.rec.temperature, dim=-1)
        return scores


class _Gather(StoppingCriteria):
    def __init__(self, rec: _TokenLogprobs):
        self.rec = rec

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        rec = self.rec
        rec.steps.append(rec._logp.gather(-1, input_ids[:, -1:]).squeeze(-1))
        rec._logp = None
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@contextlib.contextmanager
def _seeded(seed: int | None, device: torch.device):
    """Seeds the CPU and `device` generators inside a forked RNG state, so the caller's stream is untouched."""
    if seed is None:
        yield
        return
    devices = []
    if device.type == "cuda":
        devices = [device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=devices):
        torch.default_generator.manual_seed(seed)
        if devices:
            with torch.cuda.device(devices[0]):
                torch.cuda.manual_seed(seed)
        yield


class HFEngine:
    """Batched `model.generate` with left padding, in chunks of at most max_batch_size prompts; identical
    prompts in a chunk share one prefill, and on a CPU prompts are prefilled unpadded (`_prefill`).

    Sampling is plain softmax(logits / temperature) with top-p: every other logits processor a
    checkpoint's generation config may carry (top-k, repetition penalty, ...) is switched off, since
    the trainer's log-probs assume exactly that distribution.

    dtype: the precision generation computes in: bfloat16 or float16 by autocast (what Lightning's bf16-mixed
    update runs in, so `engine.dtype=auto` samples in the update's precision context), float32 in the parameters'
    own dtype (float32 master weights).
    """

    generates_with_policy = True

    def __init__(self, model, tokenizer, max_batch_size: int = 64, dtype: str = "float32"):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
        self.model = model
        self.dtype = dtype
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.stops = StopTokens(tokenizer, eos_ids(tokenizer, getattr(model, "generation_config", None)),
                                getattr(model.config, "vocab_size", None))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.stops.eos)

    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None) -> list[Generation]:
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        device = next(self.model.parameters()).device
        # Similar lengths share a chunk (less padding); the sort is stable, so the chunks, and with them
        # the seeded samples, depend only on the prompts.
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        results: list[Generation | None] = [None] * len(prompts)
        modes = [(m, m.training) for m in self.model.modules()]  # restored per module, not by train(mode)
        self.model.eval()
        try:
            with _seeded(seed, device), torch.inference_mode(), self._precision(device):
                for start in range(0, len(order), self.max_batch_size):
                    chunk = order[start:start + self.max_batch_size]
                    rows, logps = self._generate_chunk([prompts[i] for i in chunk], params, device)
                    for j, (i, row) in enumerate(zip(chunk, rows)):
                        results[i] = self.stops.finish(row, params, logps[j] if logps else None)
        finally:
            for module, mode in modes:
                module.training = mode
        return results  # type: ignore[return-value]

    def _precision(self, device: torch.device):
        if self.dtype == "float32":
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=getattr(torch, self.dtype))

    def _generate_chunk(self, prompts: list[list[int]], params: SamplingParams,
                        device: torch.device) -> tuple[list[list[int]], list[list[float]] | None]:
        width = max(len(p) for p in prompts)
        padded = [[self.pad_id] * (width - len(p)) + list(p) for p in prompts]
        mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
        input_ids = torch.tensor(padded, dtype=torch.long, device=device)  # (B, L) left-padded
        attention_mask = torch.tensor(mask, dtype=torch.long, device=device)  # (B, L)
        criteria, processors = StoppingCriteriaList(), LogitsProcessorList()
        if params.stop_at_newline:
            criteria.append(_StopAtNewline(self.stops.newline_table(device)))
        rec = _TokenLogprobs(params.temperature) if params.logprobs else None
        if rec is not None:
            processors.append(rec.processor)
            criteria.append(rec.criterion)
        # synced_gpus off: transformers turns it on for a model FSDP manages, all-reducing a "finished" flag every
        # decoding step; the engine generates with the weights gathered (`strategy.unsharded`), and ranks generate
        # different numbers of times, so those all-reduces would pair with other collectives or hang
        out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, synced_gpus=False,
                                  generation_config=self._generation_config(params), stopping_criteria=criteria,
                                  logits_processor=processors,
                                  past_key_values=self._prefill(prompts, input_ids, attention_mask, params))
        # (B, T) with T <= max_new_tokens, pad after a row's stop; log-probs (B, T) alike
        return out[:, width:].tolist(), (rec.rows() if rec is not None else None)

    def _prefill(self, prompts: list[list[int]], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 params: SamplingParams):
        """The KV cache of every row's prompt but its last token, laid out as the left-padded chunk, or None
        (then `generate` prefills the padded chunk itself). `generate` then runs only the last prompt token and
        the new ones; every row still samples its own response.

        Each distinct prompt is computed once (a group's rollouts all start from the same one). On a CPU the
        distinct prompts run unpadded too, those of one length together: a padded chunk pays for its padding
        twice, in positions and in the masked attention kernel, which cannot skip the causal half, and a chunk
        of tip requests (whole episodes of very different lengths) prefilled several times slower padded than so
        (docs/performance.md, "Costs behind the code"). Prompts
        that start alike (one task's system and task text, a group's common first turns) run that stem once
        (`_stems`). On a GPU one padded pass is cheaper than a pass per length."""
        if input_ids.shape[1] < 2:
            return None
        first: dict[tuple[int, ...], int] = {}
        rows = [first.setdefault(tuple(p), len(first)) for p in prompts]  # row -> its distinct prompt
        device = input_ids.device
        index = torch.tensor(rows, device=device)
        decoder = self.model.get_decoder()  # no logits are wanted here (the LM head runs once per sampled token)
        if device.type != "cpu":
            if len(first) == len(prompts):
                return None
            keep = torch.tensor([rows.index(u) for u in range(len(first))], device=device)
            ids, mask = input_ids[keep, :-1], attention_mask[keep, :-1]
            # generate's own position ids for left padding: real tokens count from 0, padding is masked anyway
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            cache = decoder(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True).past_key_values
            cache.batch_select_indices(index)  # (distinct, ...) -> (B, ...)
            return cache
        cached = [prompt[:-1] for prompt in first]  # what each distinct prompt's cache holds
        stems = _stems(cached)
        shared = PrefixCaches(decoder, [c[:n] for c, n in zip(cached, stems)], device)
        if not shared.ok:
            return None
        groups: dict[tuple[int, int], list[int]] = {}  # (stem, cached length) -> distinct prompts
        for u, (c, n) in enumerate(zip(cached, stems)):
            if c:  # a one-token prompt has nothing to cache: its row is all padding
                groups.setdefault((n, len(c)), []).append(u)
        width, keys, values = input_ids.shape[1] - 1, [], []  # per layer (distinct, heads, width, head dim)
        for (n, length), members in sorted(groups.items()):
            ids = torch.tensor([cached[u][n:] for u in members], device=device)  # (m, length - n): no mask
            past = shared.rows([cached[u][:n] for u in members]) if n else None
            part = decoder(input_ids=ids, past_key_values=past, use_cache=True).past_key_values  # (m, ., length, .)
            if not keys:
                if any(type(layer) is not DynamicLayer for layer in part.layers):
                    return None  # (sliding-window or other layers keep more than keys and values: pad instead)
                keys = [layer.keys.new_zeros((len(first), *layer.keys.shape[1:-2], width, layer.keys.shape[-1]))
                        for layer in part.layers]
                values = [layer.values.new_zeros((len(first), *layer.values.shape[1:-2], width,
                                                  layer.values.shape[-1])) for layer in part.layers]
            at = torch.tensor(members, device=device)
            for layer, k, v in zip(part.layers, keys, values):  # right-aligned, as left padding puts the prompt
                k[at, ..., width - length:, :] = layer.keys
                v[at, ..., width - length:, :] = layer.values
        if not keys:
            return None
        if self.dtype != "float32":
            # under autocast a float32 model's keys leave the rotary embedding in float32 while its values come out
            # of their projection in bfloat16; a static cache takes one dtype for both and refuses the other's
            # writes, a dynamic one concatenates whatever comes
            dynamic = DynamicCache(config=self.model.config)
            for i in range(len(keys)):
                dynamic.update(keys[i][index], values[i][index], i)
                keys[i] = values[i] = None
            return dynamic
        # A static cache: a dynamic one appends by copying itself whole at every new token, which for a chunk of
        # long prompts costs more than the token's forward pass
        static = StaticCache(config=self.model.config, max_cache_len=width + 1 + params.max_new_tokens)
        for i in range(len(keys)):
            static.update(keys[i][index], values[i][index], i)  # (distinct, ...) -> (B, ...), at 0..width-1
            keys[i] = values[i] = None  # layer by layer: never the chunk's whole cache twice in memory
        return static

    def _generation_config(self, params: SamplingParams) -> GenerationConfig:
        # Fields left None are filled from the checkpoint's generation config, so the neutral values are
        # spelled out: a shipped top_k=20 or repetition_penalty=1.05 would silently change the policy.
        neutral = dict(repetition_penalty=1.0, encoder_repetition_penalty=1.0, no_repeat_ngram_size=0,
                       min_length=0, num_beams=1, renormalize_logits=False)
        if params.temperature > 0:
            neutral.update(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=0,
                           typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0)
        else:
            neutral.update(do_sample=False)
        # Set only when the checkpoint sets them: a neutral min_p still costs a softmax per step, and
        # min_new_tokens next to min_length draws a warning.
        shipped = getattr(self.model, "generation_config", None)
        for name, value in (("min_p", 0.0), ("min_new_tokens", 0)):
            if getattr(shipped, name, None) is not None:
                neutral[name] = value
        return GenerationConfig(max_new_tokens=params.max_new_tokens, eos_token_id=sorted(self.stops.eos),
                                pad_token_id=self.pad_id, use_cache=True, **neutral)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Nothing to load: generation runs on the policy module itself."""

    def sleep(self) -> None:
        """Nothing to release (kept so callers can treat every engine alike)."""

    def wake_up(self) -> None:
        """Nothing to restore."""

    def group_has_work(self, has_work: bool) -> bool:
        """Generation here is this process's own: no other process waits on its calls."""
        return has_work


# What a decoder pass costs beyond its positions, in positions: a pass of a few-hundred-token prompt on the
# headline's small policy costs about as much as 30 more positions of a longer one.
_PASS_COST = 32


def _lcp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _stems(seqs: list[tuple[int, ...]]) -> list[int]:
    """Per sequence, how many of its first tokens it takes from a stem shared with others (0: none), so that the
    positions run, plus `_PASS_COST` per stem, are fewest. The sequences, sorted, are cut into runs
    (`cheapest_runs`); a run's stem is its members' longest common prefix, short of each member's last token (a
    member keeps at least one position of its own)."""
    order = sorted(range(len(seqs)), key=lambda i: seqs[i])
    lengths = [len(seqs[k]) for k in order]
    n = len(order)
    adjacent = [_lcp(seqs[order[i]], seqs[order[i + 1]]) for i in range(n - 1)]
    stem: dict[tuple[int, int], int] = {}  # (i, j) -> the stem of the run order[i:j]
    for i in range(n):
        stem[i, i + 1] = 0  # a run of one shares nothing
        common, shortest = math.inf, lengths[i]
        for j in range(i + 2, n + 1):
            common = min(common, adjacent[j - 2])
            shortest = min(shortest, lengths[j - 1])
            stem[i, j] = max(0, min(common, shortest - 1))
    total = [0]
    for length in lengths:
        total.append(total[-1] + length)

    def cost(i: int, j: int) -> float:
        positions = total[j] - total[i]
        return positions if stem[i, j] == 0 else _PASS_COST + stem[i, j] + positions - (j - i) * stem[i, j]

    stems = [0] * len(seqs)
    for i, j in cheapest_runs(n, cost):
        for k in order[i:j]:
            stems[k] = stem[i, j]
    return stems

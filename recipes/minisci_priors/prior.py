"""`minisci_bc`: a small policy with a prior, so EMPO² experiments fit on a CPU.

With SmolLM2-135M one EMPO² iteration on MiniSci takes over a minute on a laptop's CPU (docs/priors.md), so
comparing several methods over seeds is out of its reach. This preset is a
0.7M-parameter Qwen2-style model (4 layers, width 128) with a byte-level BPE trained on
MiniSci text, behaviour-cloned on gold action paths of the *dev* variations of the in-distribution
families (never the train or test variations that RL and validation use), in houses of mixed
difficulty. Like an instruct LLM it starts out knowing the action grammar and the usual order of a
task, but not where things are in an unseen house: finding them is left to exploration, which is
what EMPO² is about. It writes its own tips like any policy (it was never taught to, so they read
like actions), and it never saw a tip in a prompt.

Built by `python -m recipes.minisci_priors.prior_rounds build minisci_bc` or on a probe's first use (deterministic
for a seed; docs/priors.md gives the build time), written atomically and cached
under `$EMPO2_CACHE/models/minisci_bc-<hash>`.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from empo2.models.io import SHIPPED, build_bpe_tokenizer, build_tiny_model, cache_folders, save_cached_checkpoint
from empo2.utils import cache_root

# Kept in step with PromptBuilder's settings in conf/rollout/default.yaml (max_prompt_tokens, history_turns), so
# the clone is trained on the prompts RL gives it.
HISTORY_TURNS = 2
MAX_PROMPT_TOKENS = 512


@dataclass(frozen=True)
class BCSettings:
    """Everything the cached model depends on (its hash names the cache folder)."""

    seed: int = 0
    vocab_size: int = 1024
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    houses_per_variation: int = 2  # dev variations are replayed in this many house difficulties
    epochs: float = 2.0
    batch_size: int = 32
    lr: float = 3e-3
    version: int = 1  # bump when the data or the recipe changes

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def _houses(rng: random.Random, n: int) -> list[dict]:
    return [{"num_rooms": rng.choice((4, 5, 6)), "num_decoys": rng.choice((0, 1, 2)),
             "num_distractors": rng.choice((0, 1, 2))} for _ in range(n)]


def dev_instances(rng: random.Random, houses_per_variation: int):
    """(family, dev variation, house kwargs) of every in-distribution family, `houses_per_variation` house
    draws from `rng` each: the only instances a prior is trained on (never train or test variations)."""
    from empo2.envs.minisci import FAMILIES, OOD_FAMILIES, catalogue

    cat = catalogue()
    for family in FAMILIES:
        if family in OOD_FAMILIES:
            continue
        for variation in cat.split(family, "dev"):
            for house in _houses(rng, houses_per_variation):
                yield family, variation, house


def gold_episodes(settings: BCSettings) -> list[tuple[str, list[tuple[str, str]]]]:
    """(task description, [(observation, gold action), ...]) for every dev variation and house draw."""
    from empo2.envs import make_env

    episodes = []
    for family, variation, house in dev_instances(random.Random(settings.seed), settings.houses_per_variation):
        env = make_env("minisci", max_steps=100, **house)
        obs, info = env.reset(task=family, variation=variation)
        turns, won = [], False
        for action in env.gold_actions():
            turns.append((obs, action))
            result = env.step(action)
            obs, won = result.obs, result.info["won"]
        if not won:  # a planner bug would teach the clone a losing path
            raise RuntimeError(f"the gold path of {family}/{variation} in house {house} does not win")
        episodes.append((info["task_description"], turns))
    return episodes


# What the loss does with the token at each position of a training sequence: predict it as a target, predict
# it as context with weight `lm_weight` (dense next-token signal, as pretraining gives an LLM), or skip it.
# A SOFT target is learned as a whole next-token distribution (distillation): its example is (ids, kinds, probs)
# with probs (number of SOFT positions, V), one row per SOFT position in order; others are (ids, kinds).
CONTEXT, TARGET, IGNORED, SOFT = 0, 1, -1, 2
_PAD = -2


def as_sequence(prompt: list[int], target: list[int]) -> tuple[list[int], list[int]]:
    """(ids, kinds) of one prompt followed by its target."""
    return prompt + target, [CONTEXT] * len(prompt) + [TARGET] * len(target)


def clone_examples(builder, episodes) -> list[tuple[list[int], list[int]]]:
    """(ids, kinds) per gold step: the collector's own prompt (built by its PromptBuilder), then the action and
    end of turn as the target."""
    eos = builder.tokenizer.eos_token_id
    examples = []
    for task, turns in episodes:
        for t, (obs, action) in enumerate(turns):
            prompt = builder.build(task, turns[:t], obs).ids
            examples.append(as_sequence(prompt, builder.tokenizer.encode(action, add_special_tokens=False) + [eos]))
    return examples


def _batch(examples, pad_id: int):
    """Right-padded (input_ids, attention_mask, kinds); padded positions have kind `_PAD`."""
    width = max(len(ex[0]) for ex in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)  # (B, T)
    kinds = torch.full_like(ids, _PAD)
    for i, (seq, k, *_) in enumerate(examples):
        ids[i, :len(seq)] = torch.tensor(seq)
        kinds[i, :len(seq)] = torch.tensor(k)
    return ids, (kinds != _PAD).long(), kinds


def clone_loss(logits: torch.Tensor, ids: torch.Tensor, kinds: torch.Tensor, lm_weight: float = 0.0,
               soft: torch.Tensor | None = None):
    """Mean over the TARGET and SOFT tokens of their cross-entropy + `lm_weight` x mean NLL of the CONTEXT tokens;
    returns (loss, that target mean). A TARGET token's is its NLL; a SOFT token's is -sum_v p(v) log q(v) with p its
    row of `soft` ((number of SOFT positions, V), rows in row-major order of the positions), which exceeds
    KL(p || q) by p's entropy, so its gradient is the distillation gradient.

    logits (B, T, V) predict ids[:, t + 1] at position t, so the first token of a sequence is never scored.
    """
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")  # (B, T-1)
    kind = kinds[:, 1:]
    scored = nll[kind == TARGET]
    if soft is not None:
        log_q = torch.log_softmax(logits[:, :-1][kind == SOFT], dim=-1)  # (number of SOFT positions, V)
        scored = torch.cat([scored, -(soft * log_q).sum(-1)])
    target = scored.mean()
    context = nll[kind == CONTEXT]  # (a batch of sequences whose context is all IGNORED has none)
    loss = target + lm_weight * context.mean() if lm_weight and context.numel() else target
    return loss, target.detach()


def _epoch_order(rng: random.Random, lengths: list[int], batch_size: int, by_length: bool) -> list[int]:
    """One shuffled pass over the examples; with `by_length`, consecutive batches hold examples of similar
    length (sorted within windows of 16 batches, batch order shuffled), so few positions are padding."""
    order = rng.sample(range(len(lengths)), len(lengths))
    if not by_length:
        return order
    window = 16 * batch_size
    batches = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start:start + window], key=lambda i: lengths[i])
        batches += [chunk[b:b + batch_size] for b in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return [i for batch in batches for i in batch]


def behaviour_clone(model, examples, settings: BCSettings, pad_id: int, log=print, name: str = "minisci_bc",
                    by_length: bool = False, lm_weight: float = 0.0,
                    auxiliary: Callable[[], torch.Tensor] | None = None,
                    auxiliary_params: list[torch.nn.Parameter] | tuple = ()) -> dict:
    """`clone_loss` over (ids, kinds) or (ids, kinds, probs) sequences, AdamW with a cosine schedule; returns
    training stats.
    `by_length` batches sequences of similar length together (worth it when lengths spread widely).
    `auxiliary`, called once per step, returns a loss added to the clone loss (a second objective on its own
    batches, e.g. `prior_tips.signature_match_loss`); `auxiliary_params` (a head it trains) join the optimizer."""
    rng = random.Random(settings.seed)
    lengths = [len(ex[0]) for ex in examples]
    steps = max(1, math.ceil(settings.epochs * len(examples) / settings.batch_size))
    params = [*model.parameters(), *auxiliary_params]
    opt = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    model.train()
    t0, losses, aux_losses = time.perf_counter(), [], []
    order: list[int] = []
    for step in range(steps):
        if len(order) < settings.batch_size:
            order += _epoch_order(rng, lengths, settings.batch_size, by_length)
        batch, order = [examples[i] for i in order[: settings.batch_size]], order[settings.batch_size:]
        ids, _, kinds = _batch(batch, pad_id)
        soft = [ex[2] for ex in batch if len(ex) > 2]
        # No attention mask: padding is on the right and attention is causal, so no real position ever sees a
        # pad token, and the unmasked causal kernel skips the masked half of the attention (~30% per step).
        loss, target_nll = clone_loss(model(input_ids=ids).logits, ids, kinds, lm_weight,
                                      torch.cat(soft) if soft else None)
        if auxiliary is not None:
            extra = auxiliary()
            loss = loss + extra
            aux_losses.append(extra.item())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(target_nll.item())
        if step % 50 == 0 or step == steps - 1:
            extra = f" auxiliary {sum(aux_losses[-50:]) / len(aux_losses[-50:]):.3f}" if aux_losses else ""
            log(f"{name}: step {step + 1}/{steps} loss {sum(losses[-50:]) / len(losses[-50:]):.3f}{extra} "
                f"({time.perf_counter() - t0:.0f} s)")
    model.eval()
    stats = {"steps": steps, "examples": len(examples), "final_loss": sum(losses[-20:]) / len(losses[-20:]),
             "seconds": time.perf_counter() - t0}
    return stats | ({"final_auxiliary_loss": sum(aux_losses[-20:]) / len(aux_losses[-20:])} if aux_losses else {})


def build_minisci_bc(settings: BCSettings, log=print):
    """Tokenizer and cloned model, from scratch."""
    from empo2.memory.tips import tip_request_message
    from empo2.rollout.prompts import DEFAULT_SYSTEM_PROMPT, PromptBuilder

    episodes = gold_episodes(settings)
    corpus = [DEFAULT_SYSTEM_PROMPT, tip_request_message()["content"]]
    corpus += [task for task, _ in episodes] + [text for _, turns in episodes for pair in turns for text in pair]
    tok = build_bpe_tokenizer(corpus, settings.vocab_size)
    builder = PromptBuilder(tok, max_prompt_tokens=MAX_PROMPT_TOKENS, history_turns=HISTORY_TURNS)
    examples = clone_examples(builder, episodes)
    model = build_tiny_model(tok, settings.seed, hidden_size=settings.hidden_size, num_layers=settings.num_layers,
                             num_heads=settings.num_heads)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        stats = behaviour_clone(model, examples, settings, tok.pad_token_id, log)
    stats["episodes"] = len(episodes)
    stats["parameters"] = sum(p.numel() for p in model.parameters())
    return model, tok, stats


def cache_dir(settings: BCSettings | None = None, name: str = "minisci_bc") -> Path:
    return cache_root() / "models" / f"{name}-{(settings or BCSettings()).key()}"


def ready_path(name: str, settings: BCSettings) -> Path | None:
    """Where the finished prior `name` with these settings is: the cache (under the name it was built with), else
    the shipped copy, else None."""
    target = cache_dir(settings, name)
    for path in (*(target.parent / folder for folder in cache_folders(name, target.name)), SHIPPED / target.name):
        if (path / "empo2_source.json").is_file():  # written last: its presence means a finished build
            return path
    return None


def ensure_cached(name: str, settings: BCSettings, build, log=print, source: dict | None = None) -> Path:
    """Path of the prior `name` (cached or shipped), building it with `build(settings, log)` on first use
    (temp dir + rename: never half-written); `source` adds entries to its `empo2_source.json`."""
    ready = ready_path(name, settings)
    if ready is not None:
        return ready
    target = cache_dir(settings, name)
    if target.exists():
        shutil.rmtree(target)
    log(f"{name}: building the policy once (cached at {target})")
    model, tok, stats = build(settings, log)
    save_cached_checkpoint(model, tok, {"settings": asdict(settings), "stats": stats, **(source or {})}, target)
    return target


def ensure_minisci_bc(settings: BCSettings | None = None, log=print) -> Path:
    """Path of the cached clone, building it on first use."""
    return ensure_cached("minisci_bc", settings or BCSettings(), build_minisci_bc, log)

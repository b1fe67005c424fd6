"""EMPO² algorithm math: pure functions over tensors and plain scalars.

Shapes: ``R`` trajectories, ``S`` steps per trajectory, ``B`` samples in a micro-batch, ``T`` response
tokens (right-padded), ``V`` vocabulary size. Nothing here reads a config object, touches I/O or
holds state, so every function can be checked in isolation and called from the collector, the
Lightning module and outside scripts alike.

How the paper's mechanisms map onto these functions:

- multi-step GRPO: the episode return ``R_i`` of each trajectory is normalised within its group of
  rollouts of the same task instance (`group_advantages`); every step of a trajectory reuses it;
- state-novelty exploration: ``r_int(s) = 1/n(s)`` (`count_bonus`) summed over an episode and added
  to the extrinsic return with weight ``beta`` (`mix_returns`, `beta_at`), *before* the advantage;
  the released code's variant pays ``1/(count+1)`` for the tips a memory-mode step retrieved
  (`retrieval_bonus`);
- hybrid rollouts / updates: memory mode with probability ``p`` and, for memory-augmented samples,
  off-policy update with probability ``q`` (`draw_memory_modes`, `draw_update_modes`);
- off-policy stability: tokens whose probability under the tip-free target policy is below
  ``delta`` are dropped from the loss (`low_prob_mask`, `empo2_loss_mask`);
- the update itself: one dual-clip PPO loss (`policy_loss`) for both update modes: the off-policy
  mode only changes which prompt the log-probs come from and which tokens the mask keeps.
"""

from __future__ import annotations

import math

import torch

# exp(20) ~ 4.9e8: large enough never to bind for sane updates, small enough that ratio * advantage
# stays finite in float32 when a stale or mismatched log-prob makes the raw log-ratio explode.
LOG_RATIO_CLAMP = 20.0

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
GRANULARITIES = ("step", "episode", "batch")


def _check_prob(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a probability in [0, 1], got {value}")


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"shape mismatch: {shapes}")


# ----------------------------------------------------------------------------------------------
# Returns and advantages
# ----------------------------------------------------------------------------------------------


def group_advantages(
    returns: torch.Tensor, group_ids: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-relative advantage of multi-step GRPO: ``(R_i - mean_g) / (std_g + eps)``.

    Each trajectory ``i`` is compared with the other rollouts of the same task instance (its group
    ``g``). ``std_g`` is the unbiased (ddof=1) standard deviation. A group of one, or a group whose
    returns are all equal, carries no learning signal and gets exactly 0 (rather than rounding noise
    divided by ``eps``). ``normalize_std=False`` gives ``R_i - mean_g`` (Dr.GRPO-style, no std
    scaling).

    Args:
        returns: (R,) episode returns (extrinsic plus ``beta`` times intrinsic, see `mix_returns`).
        group_ids: (R,) integer group ids; arbitrary, non-contiguous values are fine.
        normalize_std: divide by ``std_g + eps``.
        eps: added to the std; must be >= 0.

    Returns:
        (R,) advantages in float32 (float64 if ``returns`` is float64).
    """
    if returns.dim() != 1:
        raise ValueError(f"returns must be 1-D (R,), got shape {tuple(returns.shape)}")
    _check_same_shape(returns=returns, group_ids=group_ids)
    if group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    out_dtype = torch.promote_types(returns.dtype, torch.float32)
    # float64 inside: R is small and this keeps group means exact enough for the zero-spread test
    x = returns.detach().to(torch.float64)
    _, inv = torch.unique(group_ids, return_inverse=True)  # (R,) group index in [0, G)
    num_groups = int(inv.max().item()) + 1 if inv.numel() else 0
    zeros = x.new_zeros(num_groups)  # (G,)
    count = zeros.index_add(0, inv, torch.ones_like(x))  # (G,)
    mean = zeros.index_add(0, inv, x) / count.clamp(min=1)  # (G,)
    dev = x - mean[inv]  # (R,)
    # exact zero-spread detection: max == min within the group (covers groups of one)
    gmax = zeros.scatter_reduce(0, inv, x, reduce="amax", include_self=False)  # (G,)
    gmin = zeros.scatter_reduce(0, inv, x, reduce="amin", include_self=False)  # (G,)
    has_spread = (gmax > gmin)[inv]  # (R,)
    if normalize_std:
        var = zeros.index_add(0, inv, dev * dev) / (count - 1).clamp(min=1)  # (G,) unbiased
        dev = dev / (var.sqrt()[inv] + eps)
    return torch.where(has_spread, dev, torch.zeros_like(dev)).to(out_dtype)


def count_bonus(counts: torch.Tensor) -> torch.Tensor:
    """State-novelty intrinsic reward of EMPO²: ``r_int(s) = 1 / n(s)``.

    ``n(s)`` is the visit count of state ``s`` including the current visit, so it is >= 1 by
    construction; counts below 1 are clamped to 1 so a counter that has not yet recorded the visit
    yields the maximal bonus 1 instead of inf.

    Args:
        counts: any shape, integer or float visit counts.

    Returns:
        Same shape, float32 (float64 if ``counts`` is float64).
    """
    counts = torch.as_tensor(counts)
    out_dtype = (
        torch.promote_types(counts.dtype, torch.float32) if counts.is_floating_point() else torch.float32
    )
    return 1.0 / counts.to(out_dtype).clamp(min=1.0)


def retrieval_bonus(retrieved: torch.Tensor, memory_mode: torch.Tensor) -> torch.Tensor:
    """The released code's intrinsic reward: ``1 / (count + 1)`` on a memory-mode step, where ``count`` is
    the number of tips retrieved for that step's prompt (so 1 when the memory had nothing to offer), and
    0 on a step without memory (its agent sets ``intrinsic_reward = 0.0`` when tips are off).

    Args:
        retrieved: (S,) tips retrieved per step (>= 0; any value on steps without memory).
        memory_mode: (S,) bool, True where the step's prompt was memory-augmented.

    Returns:
        (S,) float64 bonuses.
    """
    _check_same_shape(retrieved=retrieved, memory_mode=memory_mode)
    retrieved = torch.as_tensor(retrieved, dtype=torch.float64)
    if bool((retrieved[memory_mode.bool()] < 0).any()):
        raise ValueError("retrieved tip counts must be >= 0")
    return torch.where(memory_mode.bool(), 1.0 / (retrieved.clamp(min=0) + 1.0), torch.zeros_like(retrieved))


def mix_returns(ext_returns: torch.Tensor, intrinsic_sums: torch.Tensor, beta: float) -> torch.Tensor:
    """Episode return used by the advantage: ``R = R_ext + beta * sum_t r_int(s_t)``.

    The intrinsic term enters the return *before* `group_advantages`, so ``beta > 0`` with unequal
    novelty sums necessarily changes the advantages (it cannot be computed and then dropped).

    Args:
        ext_returns: (R,) extrinsic episode returns.
        intrinsic_sums: (R,) per-trajectory sums of `count_bonus` over its steps.
        beta: intrinsic weight, >= 0 (see `beta_at` for a schedule); 0 is the no-intrinsic ablation.

    Returns:
        (R,) mixed returns.
    """
    _check_same_shape(ext_returns=ext_returns, intrinsic_sums=intrinsic_sums)
    if not (math.isfinite(beta) and beta >= 0):
        raise ValueError(f"beta must be a finite number >= 0, got {beta}")
    return ext_returns + beta * intrinsic_sums


def beta_at(step: int, total_steps: int, start: float, end: float, schedule: str = "linear") -> float:
    """Intrinsic-reward weight ``beta`` at a training step (paper: 0.8 -> 0.2 linearly).

    ``"constant"`` returns ``start``. ``"linear"`` interpolates from ``start`` at step 0 to ``end`` at
    ``total_steps`` and stays at ``end`` afterwards; ``total_steps <= 0`` means the schedule has no
    length, so it is already finished and returns ``end``.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if schedule == "constant":
        return float(start)
    if schedule != "linear":
        raise ValueError(f"unknown beta schedule {schedule!r}; expected 'linear' or 'constant'")
    if total_steps <= 0:
        return float(end)
    frac = min(step / total_steps, 1.0)
    return float(start + (end - start) * frac)


# ----------------------------------------------------------------------------------------------
# Hybrid rollout / update modes
# ----------------------------------------------------------------------------------------------


def _bernoulli(
    num_trajectories: int, num_steps: int, prob: float, granularity: str, generator: torch.Generator
) -> torch.Tensor:
    """(R, S) bool draws with probability ``prob`` shared across the chosen granularity."""
    if granularity == "batch":
        shape = (1, 1)
    elif granularity == "episode":
        shape = (num_trajectories, 1)
    elif granularity == "step":
        shape = (num_trajectories, num_steps)
    else:
        raise ValueError(f"unknown granularity {granularity!r}; expected one of {GRANULARITIES}")
    # rand is in [0, 1): `< 0` is never true and `< 1` always is, so p=0 / p=1 are exact
    draws = torch.rand(shape, generator=generator, device=generator.device) < prob
    return draws.expand(num_trajectories, num_steps).contiguous()  # (R, S)


def draw_memory_modes(
    num_trajectories: int, num_steps: int, p: float, granularity: str, generator: torch.Generator
) -> torch.Tensor:
    """Hybrid rollouts: which (trajectory, step) prompts carry retrieved tips, with probability ``p``.

    ``granularity`` sets what one Bernoulli draw covers: ``"batch"`` one draw for the whole batch (the
    released code), ``"episode"`` one per trajectory broadcast over its steps, ``"step"`` one per
    (trajectory, step). The number of draws depends only on the shapes, so a seeded generator gives
    reproducible modes. ``p=0`` is the no-memory ablation (plain multi-step GRPO).

    Returns:
        (R, S) bool, True where the prompt is memory-augmented.
    """
    _check_prob("p", p)
    if num_trajectories < 0 or num_steps < 0:
        raise ValueError(f"sizes must be >= 0, got ({num_trajectories}, {num_steps})")
    return _bernoulli(num_trajectories, num_steps, p, granularity, generator)


def draw_update_modes(
    memory_mask: torch.Tensor, q: float, granularity: str, generator: torch.Generator
) -> torch.Tensor:
    """Hybrid updates: which memory-augmented samples are updated off-policy, with probability ``q``.

    An off-policy sample is trained on the tip-free prompt against behaviour log-probs from the tip
    prompt (reward-guided distillation of the tips); the rest keep the tips (on-policy). Draws are
    made at the same granularity as the memory modes and always for the full (R, S) layout, so the
    generator stream does not depend on the memory draws. ``q=0`` is the no-off-policy ablation.

    Args:
        memory_mask: (R, S) bool from `draw_memory_modes`.

    Returns:
        (R, S) bool, True only where ``memory_mask`` is True and the off-policy draw succeeded.
    """
    _check_prob("q", q)
    if memory_mask.dim() != 2 or memory_mask.dtype != torch.bool:
        raise ValueError(
            f"memory_mask must be a 2-D bool tensor (R, S), got {memory_mask.dtype} "
            f"{tuple(memory_mask.shape)}"
        )
    num_trajectories, num_steps = memory_mask.shape
    draws = _bernoulli(num_trajectories, num_steps, q, granularity, generator)  # (R, S)
    return draws.to(memory_mask.device) & memory_mask


# ----------------------------------------------------------------------------------------------
# Masks
# ----------------------------------------------------------------------------------------------


def low_prob_mask(
    logprobs: torch.Tensor, response_mask: torch.Tensor, delta: float, mode: str = "token"
) -> torch.Tensor:
    """Low-probability token mask of EMPO²'s off-policy update.

    Off-policy tokens were sampled with tips in the prompt; those the tip-free target policy finds
    very unlikely (``pi(a) < delta``) produce exploding importance ratios, so they are dropped.
    ``mode="token"`` keeps a token when ``exp(logprob) >= delta`` (compared as
    ``logprob >= log(delta)``, exact for tiny probabilities); ``mode="sequence"`` keeps a whole
    response only when every valid token passes. ``delta=0`` keeps every valid token. The mask is
    always False at invalid (padding) positions; values there are ignored, NaN included.

    Args:
        logprobs: (B, T) token log-probs under the target policy; detached here.
        response_mask: (B, T) bool or 0/1, True at valid response tokens.
        delta: probability threshold in [0, 1).
        mode: ``"token"`` or ``"sequence"``.

    Returns:
        (B, T) bool.
    """
    if not 0.0 <= delta < 1.0:
        raise ValueError(f"delta must be in [0, 1), got {delta}")
    if mode not in ("token", "sequence"):
        raise ValueError(f"unknown low-prob mask mode {mode!r}; expected 'token' or 'sequence'")
    _check_same_shape(logprobs=logprobs, response_mask=response_mask)
    valid = response_mask.bool()
    log_delta = math.log(delta) if delta > 0 else -math.inf
    passes = logprobs.detach().float() >= log_delta  # (B, T)
    if mode == "sequence":
        seq_ok = (passes | ~valid).all(dim=-1, keepdim=True)  # (B, 1)
        passes = seq_ok.expand_as(valid)  # (B, T)
    return passes & valid


def empo2_loss_mask(
    response_mask: torch.Tensor,
    target_logprobs: torch.Tensor,
    offpolicy: torch.Tensor,
    delta: float,
    mode: str = "token",
    scope: str = "offpolicy",
) -> torch.Tensor:
    """The loss mask that turns `policy_loss` into EMPO²'s hybrid update.

    The low-probability mask (`low_prob_mask`, on the target i.e. tip-free learner log-probs, detached)
    is applied to off-policy samples only (``scope="offpolicy"``, the paper's setting) or to every
    sample (``scope="all"``); samples it does not apply to keep their full response mask.

    Args:
        response_mask: (B, T) bool or 0/1 valid response tokens.
        target_logprobs: (B, T) learner log-probs on the training prompt (tip-free when off-policy), or the
            behaviour (old) log-probs for the released code's variant.
        offpolicy: (B,) bool update mode of each sample.
        delta: threshold in [0, 1); 0 disables the mask.
        mode: ``"token"`` or ``"sequence"``, see `low_prob_mask`.
        scope: ``"offpolicy"`` or ``"all"``.

    Returns:
        (B, T) bool loss mask for `policy_loss`.
    """
    if scope not in ("offpolicy", "all"):
        raise ValueError(f"unknown mask scope {scope!r}; expected 'offpolicy' or 'all'")
    if offpolicy.shape != response_mask.shape[:1] or response_mask.dim() != 2:
        raise ValueError(
            f"offpolicy must be (B,) for response_mask (B, T), got {tuple(offpolicy.shape)} "
            f"and {tuple(response_mask.shape)}"
        )
    valid = response_mask.bool()
    kept = low_prob_mask(target_logprobs, valid, delta, mode)  # (B, T)
    if scope == "all":
        return kept
    return torch.where(offpolicy.bool()[:, None], kept, valid)  # (B, T)


# ----------------------------------------------------------------------------------------------
# Losses
# ----------------------------------------------------------------------------------------------


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    response_mask: torch.Tensor | None = None,
    num_tokens: int | None = None,
    num_seqs: int | None = None,
) -> torch.Tensor:
    """Aggregate a (B, T) per-token loss over the kept tokens into a scalar.

    - ``"token-mean"``: sum over kept tokens / number of valid tokens (the released code's choice;
      long responses weigh more).
    - ``"seq-mean-token-mean"``: sum over each response's kept tokens / its valid tokens, then mean over
      responses.
    - ``"seq-mean-token-sum"``: sum over each response's kept tokens, then mean over responses.

    Denominators count *valid* tokens (``response_mask``; ``mask`` itself when it is not given), not
    kept ones: a token that the loss mask removes (EMPO²'s low-probability mask) counts as a zero-loss
    token, so masking shrinks the update instead of re-weighting the surviving tokens. This is what
    makes the aggregate splittable: the valid counts of a whole mini-batch are known before any of its
    micro-batches runs, while the kept counts are only known after the learner has scored them. Pass
    the mini-batch's ``num_tokens`` (valid tokens) and ``num_seqs`` (responses) when ``loss_mat`` is one
    micro-batch of it: the micro-batch aggregates then sum exactly to the mini-batch aggregate,
    whatever the split, over micro-batches and over data-parallel ranks (with the global mini-batch's
    counts). Without them the denominators are this batch's own; responses without a valid
    token are not counted.

    Denominators are clamped to 1: an all-masked input gives exactly 0 with zero gradient. Values at
    masked positions never reach the result or its gradient, even when they are NaN or inf.

    Args:
        loss_mat: (B, T) per-token loss.
        mask: (B, T) bool or 0/1, True where the token enters the loss.
        mode: one of ``AGG_MODES``.
        response_mask: (B, T) valid response tokens (``mask`` must lie inside it); default ``mask``.
        num_tokens: valid tokens of the whole mini-batch (token-mean), default this batch's.
        num_seqs: responses of the whole mini-batch (sequence modes), default this batch's.

    Returns:
        Scalar tensor.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {AGG_MODES}")
    _check_same_shape(loss_mat=loss_mat, mask=mask)
    valid = mask.bool() if response_mask is None else response_mask.bool()
    _check_same_shape(loss_mat=loss_mat, response_mask=valid)
    keep = mask.bool() & valid
    loss_mat = torch.where(keep, loss_mat, torch.zeros_like(loss_mat))  # where, not *: NaN * 0 is NaN
    tokens = valid.sum(dim=-1)  # (B,)
    # tensor denominators stay on the device (no host sync per micro-batch); given counts are plain ints
    if mode == "token-mean":
        denom = tokens.sum().clamp(min=1) if num_tokens is None else max(num_tokens, 1)
        return loss_mat.sum() / denom
    seq_loss = loss_mat.sum(dim=-1)  # (B,)
    if mode == "seq-mean-token-mean":
        seq_loss = seq_loss / tokens.clamp(min=1)
    denom = (tokens > 0).sum().clamp(min=1) if num_seqs is None else max(num_seqs, 1)
    return seq_loss.sum() / denom


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.3,
    dual_clip_c: float | None = 10.0,
    agg: str = "token-mean",
    response_mask: torch.Tensor | None = None,
    num_tokens: int | None = None,
    num_seqs: int | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Dual-clip PPO surrogate, the single loss of both EMPO² update modes.

    ``ratio = exp(clamp(logprobs - old_logprobs, -20, 20))``;
    ``l = max(-A * ratio, -A * clamp(ratio, 1 - clip_low, 1 + clip_high))`` (asymmetric clip);
    for ``A < 0`` additionally ``l = min(l, -A * dual_clip_c)`` (dual clip; ``None`` disables it);
    then aggregated over ``loss_mask`` by `agg_loss`. On-policy, ``old_logprobs`` and ``logprobs``
    share the prompt; off-policy, ``old_logprobs`` come from the tip prompt and ``logprobs`` from the
    tip-free prompt, and ``loss_mask`` carries the low-probability mask (`empo2_loss_mask`).

    Computed in float32 whatever the input dtype. ``old_logprobs`` and ``advantages`` are treated as
    constants (detached). Masked positions never affect the loss or any gradient, whatever they hold.
    Tokens whose log-ratio hits the clamp get zero gradient.

    Args:
        logprobs: (B, T) learner log-probs (with grad).
        old_logprobs: (B, T) behaviour log-probs.
        advantages: (B,) broadcast over tokens, or (B, T).
        loss_mask: (B, T) bool or 0/1, tokens that enter the loss.
        clip_low, clip_high: ratio clip range ``[1 - clip_low, 1 + clip_high]``.
        dual_clip_c: dual-clip constant (> 1), or None.
        agg: aggregation mode, see `agg_loss`.
        response_mask: (B, T) valid response tokens: the denominators of `agg_loss` (masked tokens count
            as zero-loss tokens) and the ``masked_frac`` metric; default ``loss_mask``.
        num_tokens, num_seqs: the mini-batch's valid tokens and responses when this is one micro-batch of
            it (see `agg_loss`), so micro-batch losses add up to the mini-batch loss.
        token_weights: (B, T) constants each token's clipped loss is multiplied by before aggregation
            (truncated importance sampling, `truncated_is_weights`); None: 1 everywhere.

    Returns:
        ``(loss, metrics)``: scalar float32 loss and python floats, each a mean over kept tokens
        (0.0 when none is kept):
        ``clip_frac`` (tokens where the clipped term is active, i.e. zero gradient from the clip),
        ``dual_clip_frac`` (tokens where the dual clip is active), ``approx_kl`` (k3 estimate of
        KL(old || new): ``ratio - 1 - log ratio``, >= 0), ``ratio_mean``, and ``masked_frac``: the
        fraction of valid response tokens (``response_mask``) that ``loss_mask`` removes, 0.0 when
        ``response_mask`` is None (``loss_mask`` is then taken as the response mask).
    """
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
    if clip_high < 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    if dual_clip_c is not None and not dual_clip_c > 1.0:
        raise ValueError(f"dual_clip_c must be > 1 or None, got {dual_clip_c}")
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, loss_mask=loss_mask)
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be (B, T), got {tuple(logprobs.shape)}")
    if response_mask is not None:
        _check_same_shape(logprobs=logprobs, response_mask=response_mask)
    if advantages.dim() == 1 and advantages.shape[0] == logprobs.shape[0]:
        advantages = advantages[:, None].expand_as(logprobs)  # (B,) -> (B, T)
    elif advantages.shape != logprobs.shape:
        raise ValueError(
            f"advantages must be (B,) or (B, T) for logprobs {tuple(logprobs.shape)}, "
            f"got {tuple(advantages.shape)}"
        )

    keep = loss_mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=logprobs.device)
    # where() passes exactly zero gradient to masked positions, so padding (even NaN/inf, or a NaN
    # advantage) cannot reach the gradient; agg_loss keeps it out of the value
    log_ratio = torch.where(keep, logprobs.float() - old_logprobs.detach().float(), zero)  # (B, T)
    adv = advantages.detach().float()  # (B, T)
    log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)  # (B, T)

    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(loss_unclipped, loss_clipped)  # (B, T)
    dual_active = torch.zeros_like(keep)
    if dual_clip_c is not None:
        # for A < 0 a tiny-probability token with a huge ratio would push unboundedly; cap at -A * c
        loss_dual = -adv * dual_clip_c
        dual_active = (adv < 0) & (loss_dual < loss_mat)
        loss_mat = torch.where(dual_active, loss_dual, loss_mat)
    if token_weights is not None:
        _check_same_shape(logprobs=logprobs, token_weights=token_weights)
        loss_mat = loss_mat * token_weights.detach().float()
    loss = agg_loss(loss_mat, keep, agg, response_mask, num_tokens, num_seqs)

    with torch.no_grad():
        n_keep = keep.sum().clamp(min=1)

        def kept_mean(x: torch.Tensor) -> float:
            return (torch.where(keep, x.float(), zero).sum() / n_keep).item()

        if response_mask is None:
            masked_frac = 0.0
        else:
            valid = response_mask.bool()
            masked_frac = ((valid & ~keep).sum() / valid.sum().clamp(min=1)).item()
        metrics = {
            "clip_frac": kept_mean(loss_clipped > loss_unclipped),
            "dual_clip_frac": kept_mean(dual_active),
            "approx_kl": kept_mean(ratio - 1.0 - log_ratio),
            "ratio_mean": kept_mean(ratio),
            "masked_frac": masked_frac,
        }
    return loss, metrics


def truncated_is_weights(
    old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, response_mask: torch.Tensor, cap: float
) -> torch.Tensor:
    """Truncated importance sampling (TIS) weights of the sampler/trainer gap: ``min(pi_old / pi_engine, cap)``.

    The responses were sampled by the generation engine (``pi_engine``, e.g. vLLM in bfloat16), while the clipped
    ratio assumes they came from ``pi_old``, the trainer's scoring of the same tokens before the update. Weighting
    each token's loss by ``pi_old / pi_engine`` corrects the expectation to ``pi_old``'s; truncating at ``cap``
    bounds the variance a token the engine found much less likely than the trainer would add (Yao et al. 2025,
    "Your efficient RL framework secretly brings you off-policy RL training"; TRL's token-level truncation,
    verl's ``rollout_is``). A token whose engine log-prob equals ``pi_old``'s gets exactly 1, so pass
    ``old_logprobs`` itself as ``engine_logprobs`` for samples without engine log-probs.

    Args:
        old_logprobs: (B, T) trainer log-probs of the behaviour prompt (detached here).
        engine_logprobs: (B, T) the engine's log-probs of the same tokens (detached here).
        response_mask: (B, T) valid response tokens; the weight is 1 elsewhere (values there are ignored).
        cap: truncation C > 0.

    Returns:
        (B, T) float32, detached.
    """
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    _check_same_shape(old_logprobs=old_logprobs, engine_logprobs=engine_logprobs, response_mask=response_mask)
    valid = response_mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=old_logprobs.device)
    log_ratio = torch.where(valid, old_logprobs.detach().float() - engine_logprobs.detach().float(), zero)
    # a truncated token's weight is exactly `cap` (exp(log(cap)) can round below it, e.g. cap 7); an overflow to inf
    # truncates like any other ratio above the cap
    return torch.exp(log_ratio).clamp(max=cap)  # (B, T)


def logprob_gap(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor) -> dict[str, float]:
    """How far the engine's sampling distribution is from the one the update assumes, on the sampled tokens.

    With ``d = log pi_old - log pi_engine`` per token (the sampled tokens of all responses, flattened):
    ``mean`` and ``max`` of ``|d|``, and ``kl``, the k3 estimate of KL(pi_engine || pi_old) from tokens drawn by the
    engine: the mean of ``exp(d) - 1 - d`` (>= 0, 0 only when the two agree on every token; TRL logs the first
    two, verl the KL).

    Args:
        old_logprobs: (N,) trainer log-probs.
        engine_logprobs: (N,) engine log-probs of the same tokens.

    Returns:
        ``{"mean": ..., "max": ..., "kl": ...}``; all 0.0 for no token.
    """
    return logprob_gap_of_totals(logprob_gap_totals(old_logprobs, engine_logprobs))


def logprob_gap_totals(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor) -> torch.Tensor:
    """What `logprob_gap` is made of, in a form data-parallel ranks combine: float64 ``(tokens, sum |d|, sum
    (exp(d) - 1 - d), max |d|)``; ranks sum the first three and take the largest of the last, and
    `logprob_gap_of_totals` of the combined totals is the gap of all their tokens together."""
    _check_same_shape(old_logprobs=old_logprobs, engine_logprobs=engine_logprobs)
    d = (old_logprobs.double() - engine_logprobs.double()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    biggest = d.abs().max() if d.numel() else d.new_zeros(())
    return torch.stack([d.new_tensor(float(d.numel())), d.abs().sum(), (torch.expm1(d) - d).sum(), biggest])


def logprob_gap_of_totals(totals: torch.Tensor) -> dict[str, float]:
    """`logprob_gap` from its (possibly combined) `logprob_gap_totals`; all 0.0 for no token."""
    tokens, abs_sum, kl_sum, biggest = (float(x) for x in totals)
    if tokens == 0:
        return {"mean": 0.0, "max": 0.0, "kl": 0.0}
    return {"mean": abs_sum / tokens, "max": biggest, "kl": kl_sum / tokens}


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate for an optional KL-to-reference term (off by default).

    ``"k1"``: ``logprobs - ref_logprobs`` (unbiased, can be negative). ``"k3"``:
    ``exp(d) - d - 1`` with ``d = clamp(ref_logprobs - logprobs, -20, 20)`` (unbiased, always >= 0,
    lower variance; the clamp keeps it finite). Aggregate with `agg_loss`.

    Args:
        logprobs: (B, T) learner log-probs (with grad).
        ref_logprobs: (B, T) reference-policy log-probs.
        kind: ``"k1"`` or ``"k3"``.

    Returns:
        (B, T) float32.
    """
    _check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    log_ratio = ref_logprobs.detach().float() - logprobs.float()  # (B, T)
    if kind == "k1":
        return -log_ratio
    if kind == "k3":
        log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return torch.exp(log_ratio) - log_ratio - 1.0
    raise ValueError(f"unknown KL estimator {kind!r}; expected 'k1' or 'k3'")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-token entropy of the policy for an optional entropy bonus (off by default).

    ``H = logsumexp(z) - sum_v softmax(z)_v * z_v``, stable for large logits (no explicit log of
    small probabilities). Logits must be finite. Computed in float32.

    Args:
        logits: (B, T, V).

    Returns:
        (B, T) float32.
    """
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)  # (B, T, V)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)  # (B, T)

"""The update computes what the algorithm says, with the real tiny model: split-invariant loss, exact
first-step ratios under bf16 autocast and a sampling temperature, and a generation engine that holds its
own weights synced after a resume."""

import copy
import dataclasses
import math

import lightning as L
import pytest
import torch

from empo2.algo import core_algos
from empo2.config import ModelConfig, load_config
from empo2.lit.data import RolloutBuffer, collate, plan_epoch
from empo2.lit.module import EMPO2Module, adamw
from empo2.models import load_policy
from empo2.rollout.engines import HFEngine, SamplingParams
from empo2.rollout.types import StepSample
from empo2.workflows.train import state_fingerprint, train

from .test_training import FAST, StopAfter, _weights


@pytest.fixture(scope="module")
def policy():
    return load_policy(ModelConfig(name="tiny"))


def _samples(vocab: int, n: int = 9) -> list[StepSample]:
    """Prompts and responses of very different lengths; every other sample off-policy (its train prompt is
    the behaviour prompt without a 'tip' span)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        prompt = torch.randint(3, vocab, (5 + 7 * i % 23,), generator=g).tolist()
        tips = torch.randint(3, vocab, (6,), generator=g).tolist()
        response = torch.randint(3, vocab, (1 + (5 * i) % 11,), generator=g).tolist()
        off = i % 2 == 1
        out.append(StepSample(behaviour_ids=tips + prompt if off else prompt, train_ids=prompt,
                              response_ids=response, memory=off, offpolicy=off, group_id=0, traj_id=i, step=0,
                              advantage=float(i % 3) - 1.0))
    return out


def test_gradient_checkpointing_gives_the_same_gradient(policy):
    """Activations recomputed in the backward pass instead of kept: the same loss and gradient, to the bit."""
    model, tok = policy
    cfg = load_config(["model=tiny", "algo.kl_coef=0"])
    samples = _samples(model.config.vocab_size)
    micro = plan_epoch([len(s.response_ids) for s in samples], 1, len(samples), None,
                       torch.Generator().manual_seed(0))[0][0]
    grads, passes = [], []
    for checkpointing in (False, True):
        policy_copy = copy.deepcopy(model).train()
        if checkpointing:
            policy_copy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        recomputed: list[int] = []
        handle = policy_copy.get_decoder().layers[0].register_forward_pre_hook(lambda *a, out=recomputed: out.append(1))
        module = EMPO2Module(policy_copy, tok, cfg.algo, cfg.trainer, RolloutBuffer(samples))
        module.buffer.old_logprobs = module.old_logprobs(samples, 4)
        recomputed.clear()
        loss, _, _ = module.micro_batch_loss(micro)
        loss.backward()
        handle.remove()
        passes.append(len(recomputed))
        grads.append({n: p.grad for n, p in policy_copy.named_parameters()})
    assert passes[1] == 2 * passes[0]  # every pass of the layer ran again in the backward pass
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_the_cpu_optimiser_is_fused_adamw_and_takes_torchs_default_step_to_float_rounding(policy):
    """The module's AdamW on a CPU runs the fused kernel (7x faster there than torch's default); its steps
    equal the default AdamW's to float32 rounding, and its state round-trips through `state_dict` with the
    choice, so a resumed run keeps stepping with the same kernel."""
    model, _ = policy
    models = [copy.deepcopy(model) for _ in range(3)]
    fused = adamw(list(models[0].parameters()), lr=1e-3, weight_decay=0.01)
    default = torch.optim.AdamW(models[1].parameters(), lr=1e-3, weight_decay=0.01)
    assert fused.param_groups[0]["fused"] and not default.param_groups[0]["fused"]
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=g) for p in model.parameters()]
        for m, opt in zip(models, (fused, default)):
            for p, grad in zip(m.parameters(), grads):
                p.grad = grad.clone()
            opt.step()
    pairs = list(zip(models[0].parameters(), models[1].parameters()))
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in pairs)
    assert any(not torch.equal(a, b) for a, b in zip(models[0].parameters(), model.parameters()))  # it stepped
    restored = torch.optim.AdamW(models[2].parameters(), lr=1.0)
    restored.load_state_dict(fused.state_dict())
    assert restored.param_groups[0]["fused"] and restored.param_groups[0]["lr"] == 1e-3


@pytest.mark.parametrize("agg", core_algos.AGG_MODES)
def test_mini_batch_gradient_does_not_depend_on_the_micro_batch_split(policy, agg):
    model, tok = policy
    cfg = load_config(["model=tiny", f"algo.loss_agg={agg}", "algo.kl_coef=0", "algo.entropy_coef=0.01"])
    samples = _samples(model.config.vocab_size)
    module = EMPO2Module(copy.deepcopy(model), tok, cfg.algo, cfg.trainer, RolloutBuffer(samples))
    module.buffer.old_logprobs = [lp + 0.3 * torch.randn(len(lp)) for lp in module.old_logprobs(samples, 4)]
    # delta at the median tip-free probability of the off-policy tokens: about half of them are masked
    with torch.no_grad():
        lp = torch.cat([module.old_logprobs([s], 1)[0] for s in samples if s.offpolicy])
    cfg.algo.delta = float(lp.exp().median())
    lengths = [len(s.response_ids) for s in samples]

    def grads(micro_batch_size):
        module.policy.zero_grad(set_to_none=True)
        plan = plan_epoch(lengths, 1, micro_batch_size, None, torch.Generator().manual_seed(3))
        masked = []
        for micro in plan[0]:
            loss, metrics, _ = module.micro_batch_loss(micro)
            (loss * micro.weight).backward()
            masked.append(metrics["masked_frac"])
        assert max(masked) > 0  # the delta mask is active
        return {n: p.grad.clone() for n, p in module.policy.named_parameters()}

    whole, split = grads(len(samples)), grads(1)
    for name in whole:  # relative to each gradient's norm: single float32 entries near 0 carry rounding
        assert (split[name] - whole[name]).norm() <= 1e-5 * whole[name].norm(), name
    assert any(g.abs().sum() > 0 for g in whole.values())


def test_a_micro_batch_token_budget_leaves_the_mini_batch_gradient_unchanged(policy):
    """Micro-batches cut by padded size (rows x longest prompt + response) instead of by count: the same
    samples and normalisers per mini-batch, so the same gradient to float tolerance, in more and smaller
    forward/backward passes, none over the budget unless it holds one sample."""
    model, tok = policy
    cfg = load_config(["model=tiny", "algo.kl_coef=0", "algo.entropy_coef=0.01"])
    samples = _samples(model.config.vocab_size)
    module = EMPO2Module(copy.deepcopy(model), tok, cfg.algo, cfg.trainer, RolloutBuffer(samples))
    module.buffer.old_logprobs = [lp + 0.3 * torch.randn(len(lp)) for lp in module.old_logprobs(samples, 4)]
    lengths = [len(s.response_ids) for s in samples]
    prompts = [len(s.train_ids) for s in samples]
    budget = 60

    def grads(token_budget):
        module.policy.zero_grad(set_to_none=True)
        plan = plan_epoch(lengths, 1, len(samples), None, torch.Generator().manual_seed(3), prompts, token_budget)
        for micro in plan[0]:
            loss, _, _ = module.micro_batch_loss(micro)
            (loss * micro.weight).backward()
            padded = len(micro.indices) * (max(prompts[i] for i in micro.indices) +
                                           max(lengths[i] for i in micro.indices))
            assert token_budget is None or padded <= token_budget or len(micro.indices) == 1
        return len(plan[0]), {n: p.grad.clone() for n, p in module.policy.named_parameters()}

    (n_whole, whole), (n_capped, capped) = grads(None), grads(budget)
    assert (n_whole, n_capped) == (1, 5)  # the budget cut the one micro-batch into several
    for name in whole:  # relative to each gradient's norm: single float32 entries near 0 carry rounding
        assert (capped[name] - whole[name]).norm() <= 1e-5 * whole[name].norm(), name
    assert any(g.abs().sum() > 0 for g in whole.values())


def test_entropy_bonus_enters_the_loss(policy):
    model, tok = policy
    samples = _samples(model.config.vocab_size, n=4)
    losses = {}
    for coef in (0.0, 0.5):
        cfg = load_config(["model=tiny", f"algo.entropy_coef={coef}"])
        module = EMPO2Module(copy.deepcopy(model), tok, cfg.algo, cfg.trainer, RolloutBuffer(samples))
        module.buffer.old_logprobs = module.old_logprobs(samples, 4)
        micro = plan_epoch([len(s.response_ids) for s in samples], 1, 4, None, torch.Generator().manual_seed(0))[0][0]
        loss, metrics, _ = module.micro_batch_loss(micro)
        losses[coef] = (loss.item(), metrics.get("entropy"))
    assert losses[0.0][1] is None and losses[0.5][1] > 0
    assert losses[0.5][0] == pytest.approx(losses[0.0][0] - 0.5 * losses[0.5][1], rel=1e-5)


def test_the_released_mask_reads_the_behaviour_logprobs_of_every_sample(policy):
    """algo.mask_logprobs=behaviour, mask_mode=sequence, mask_scope=all, delta=exp(-5) (released code): a response
    leaves the loss when any of its *behaviour* log-probs is below -5, whatever the learner's are."""
    model, tok = policy
    samples = _samples(model.config.vocab_size, n=4)
    cfg = load_config(["model=tiny", "algo.mask_logprobs=behaviour", "algo.mask_mode=sequence", "algo.mask_scope=all",
                       f"algo.delta={math.exp(-5)}"])
    module = EMPO2Module(copy.deepcopy(model), tok, cfg.algo, cfg.trainer, RolloutBuffer(samples))
    micro = plan_epoch([len(s.response_ids) for s in samples], 1, 4, None, torch.Generator().manual_seed(0))[0][0]
    fracs = []
    for low in (None, 0, 2):  # which sample gets one behaviour log-prob of -6
        old = [torch.zeros(len(s.response_ids)) for s in samples]  # probability 1: the mask never fires
        if low is not None:
            old[low][-1] = -6.0
        module.buffer.old_logprobs = old
        fracs.append(module.micro_batch_loss(micro)[1]["masked_frac"])
    tokens = [len(s.response_ids) for s in samples]
    # the tiny random model's own log-probs are far below -5: the learner's never decide here
    assert fracs == pytest.approx([0.0, tokens[0] / sum(tokens), tokens[2] / sum(tokens)])


def test_truncated_importance_sampling_weighs_each_tokens_policy_loss_by_the_engines_ratio(policy):
    """algo.tis_cap: every token's policy loss times min(pi_old / pi_engine, cap), as `policy_loss` computes it with
    `truncated_is_weights`; weight 1 (the plain loss) where no engine log-probs were recorded or where they are the
    old log-probs (exact mode)."""
    model, tok = policy
    samples = _samples(model.config.vocab_size, n=4)
    cfg = load_config(["model=tiny", "algo.tis_cap=2"])
    plain_cfg = load_config(["model=tiny"])
    old = [torch.full((len(s.response_ids),), -3.0) for s in samples]
    micro = plan_epoch([len(s.response_ids) for s in samples], 1, 4, None, torch.Generator().manual_seed(0))[0][0]

    def loss_of(cfg, samples):
        module = EMPO2Module(copy.deepcopy(model), tok, cfg.algo, cfg.trainer, RolloutBuffer(samples, old))
        return module.micro_batch_loss(micro)

    plain, _, _ = loss_of(plain_cfg, samples)
    assert loss_of(cfg, samples)[0].item() == plain.item()  # no engine log-probs: weight 1
    exact = [dataclasses.replace(s, engine_logprobs=o.tolist(), behaviour_logprobs=o.tolist())
             for s, o in zip(samples, old)]
    assert loss_of(cfg, exact)[0].item() == plain.item()
    # engine log-probs: -3.5 (ratio e^0.5 = 1.65) on sample 0, -6 (e^3, truncated at 2) on sample 1, -2 (e^-1) on 2
    shifts = [-0.5, -3.0, 1.0, 0.0]
    recorded = [dataclasses.replace(s, engine_logprobs=(o + d).tolist()) for s, o, d in zip(samples, old, shifts)]
    loss, metrics, _ = loss_of(cfg, recorded)
    module = EMPO2Module(copy.deepcopy(model), tok, cfg.algo, cfg.trainer, RolloutBuffer(recorded, old))
    batch = collate([recorded[i] for i in micro.indices], module.pad_id)
    mask = batch["response_mask"]
    with torch.no_grad():
        logp = module.response_logprobs(batch)
    weights = torch.tensor([[min(math.exp(-shifts[i]), 2.0)] for i in micro.indices]).expand_as(mask).float()
    o = torch.full_like(logp, -3.0)
    adv = torch.tensor([recorded[i].advantage for i in micro.indices])
    loss_mask = core_algos.empo2_loss_mask(mask, logp, torch.tensor([recorded[i].offpolicy for i in micro.indices]),
                                           cfg.algo.delta, cfg.algo.mask_mode, cfg.algo.mask_scope)
    expected, _ = core_algos.policy_loss(logp, o, adv, loss_mask, cfg.algo.clip_low, cfg.algo.clip_high,
                                         cfg.algo.dual_clip_c, cfg.algo.loss_agg, response_mask=mask,
                                         num_tokens=micro.num_tokens, num_seqs=micro.num_seqs, token_weights=weights)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert loss.item() != pytest.approx(plain.item(), rel=1e-3)
    tokens = [len(recorded[i].response_ids) for i in micro.indices]
    w = [min(math.exp(-shifts[i]), 2.0) for i in micro.indices]
    assert metrics["tis_weight_mean"] == pytest.approx(sum(t * x for t, x in zip(tokens, w)) / sum(tokens), rel=1e-5)
    assert metrics["tis_truncated_frac"] == pytest.approx(tokens[micro.indices.index(1)] / sum(tokens))


def test_rows_scored_without_a_mask_match_one_padded_pass_and_do_not_depend_on_their_batch(policy):
    """On a CPU rows are scored without a mask, right-padded in passes of similar lengths: their log-probs and
    entropies are those of one left-padded, masked forward over the whole batch, and the same whatever else is in
    the micro-batch, to float32 rounding."""
    model, tok = policy
    cfg = load_config(["model=tiny"])
    samples = _samples(model.config.vocab_size, n=9)
    samples.append(copy.deepcopy(samples[3]))  # a second row of one length: scored in one pass with its twin
    module = EMPO2Module(model, tok, cfg.algo, cfg.trainer, RolloutBuffer(samples))
    batch = collate(samples, module.pad_id)
    logp, entropy = module.response_logprobs(batch, with_entropy=True)  # (B, T) each
    T = batch["response_ids"].shape[1]
    with torch.no_grad():
        padded = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"], logits_to_keep=T + 1).logits[:, :-1].float()
    mask = batch["response_mask"]
    plain = torch.log_softmax(padded, -1).gather(-1, batch["response_ids"].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logp[mask], plain[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy[mask], core_algos.entropy_from_logits(padded)[mask], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(logp).all() and torch.isfinite(entropy).all()  # padding too (masked out of every loss)
    for b, sample in enumerate(samples):
        alone = module.response_logprobs(collate([sample], module.pad_id))[0]  # (T_b,)
        torch.testing.assert_close(alone, logp[b, :len(sample.response_ids)], rtol=1e-6, atol=1e-6)


def assert_same_gradient(got: torch.Tensor, expected: torch.Tensor) -> None:
    """The same gradient to float32 rounding, computed through other passes: an element is a sum over many
    tokens, rounded at about 1e-7 of its largest terms, so the absolute tolerance scales with the tensor's
    largest element (an absolute 1e-6 failed on elements near zero of gradients as large as 6, with two threads)."""
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5 * float(expected.abs().max()))


def _shared_prefix_samples(vocab: int) -> list[StepSample]:
    """Two tasks' rows: each task's rows start with its own system-and-task prefix (`prefix_len`), some of
    equal total length (one suffix pass), one off-policy with a tip span after the prefix; plus a row without
    a prefix and one whose prefix would leave no prompt token to the second pass."""
    g = torch.Generator().manual_seed(1)
    heads = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (11, 17)]
    out = []
    for i in range(10):
        head = heads[i % 2]
        rest = torch.randint(3, vocab, (3 + (4 * i) % 9,), generator=g).tolist()
        response = torch.randint(3, vocab, (1 + (3 * i) % 5,), generator=g).tolist()
        tips = torch.randint(3, vocab, (5,), generator=g).tolist() if i == 3 else []
        out.append(StepSample(behaviour_ids=head + tips + rest, train_ids=head + rest, response_ids=response,
                              memory=bool(tips), offpolicy=bool(tips), group_id=i % 2, traj_id=i, step=0,
                              advantage=float(i % 3) - 1.0, prefix_len=len(head)))
    out.append(copy.deepcopy(out[4]))  # a twin: same prefix, same length
    out[-1].traj_id = 10
    out.append(StepSample(behaviour_ids=heads[0], train_ids=heads[0], response_ids=[5, 6], memory=False,
                          offpolicy=False, group_id=0, traj_id=11, step=0, prefix_len=len(heads[0])))
    out.append(StepSample(behaviour_ids=heads[1][:6], train_ids=heads[1][:6], response_ids=[7], memory=False,
                          offpolicy=False, group_id=1, traj_id=12, step=0))
    return out


def test_a_shared_system_and_task_prefix_runs_once_and_changes_nothing(policy):
    """Rows that share their system-and-task prefix run it in one pass: one pass per distinct prefix, fewer
    positions in all; log-probs and entropies those of one padded pass and the gradient that of the rows scored
    whole, to float32 rounding, whatever a row is batched with."""
    model, tok = policy
    cfg = load_config(["model=tiny"])
    samples = _shared_prefix_samples(model.config.vocab_size)
    whole = [dataclasses.replace(s, prefix_len=0) for s in samples]
    positions: list[int] = []
    prefix_passes: list[tuple[int, ...]] = []

    handle = model.get_decoder().register_forward_pre_hook(_pass_counter(positions, prefix_passes), with_kwargs=True)
    grads, logps = [], []
    try:
        for rows in (samples, whole):
            module = EMPO2Module(model, tok, cfg.algo, cfg.trainer, RolloutBuffer(rows))
            model.zero_grad()
            positions.clear()
            prefix_passes.clear()
            batch = collate(rows, module.pad_id)
            logp, entropy = module.response_logprobs(batch, with_entropy=True)  # (B, T) each
            (logp * batch["response_mask"]).sum().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            logps.append((logp, entropy, sum(positions), sorted(prefix_passes)))
    finally:
        handle.remove()
        model.zero_grad()
    mask = batch["response_mask"]
    (shared, shared_ent, shared_pos, shared_prefixes), (plain, plain_ent, plain_pos, plain_prefixes) = logps
    # the two prefixes run once each; the row without a prefix and the one too short to cut run whole
    assert shared_prefixes == [(1, 11), (1, 17)] and plain_prefixes == []
    assert shared_pos < plain_pos
    torch.testing.assert_close(shared[mask], plain[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shared_ent[mask], plain_ent[mask], rtol=1e-5, atol=1e-5)
    for a, b in zip(*grads):
        assert_same_gradient(a, b)
    for b, sample in enumerate(samples):
        alone = module.response_logprobs(collate([sample], module.pad_id))[0]  # (T_b,)
        torch.testing.assert_close(alone, shared[b, :len(sample.response_ids)], rtol=1e-6, atol=1e-6)


def _pass_counter(positions: list[int], prefix_passes: list[tuple[int, ...]]):
    """A decoder forward pre-hook: each pass's positions, and the shape of each prefix pass (one handed an empty
    cache to record)."""

    def count(_, args, kwargs):
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        positions.append(ids.numel())
        past = kwargs.get("past_key_values")
        if past is not None and past.get_seq_length() == 0:
            prefix_passes.append(tuple(ids.shape))

    return count


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_shared_prefix_runs_once_under_gradient_checkpointing_too(lora):
    """Gradient checkpointing recomputes every decoder layer in the backward pass, the prefix pass's among them:
    the prefixes still run once, and the log-probs and the gradient are those of the same passes without
    checkpointing and of the rows run whole, to float32 rounding; the gradient reaches the parameters through
    the prefix pass (LoRA: only the adapters train, the embeddings stay frozen)."""
    model, tok = load_policy(ModelConfig(name="tiny", lora_r=4 if lora else 0, lora_dropout=0.0))
    cfg = load_config(["model=tiny"])
    samples = _shared_prefix_samples(model.config.vocab_size)
    whole = [dataclasses.replace(s, prefix_len=0) for s in samples]
    runs = {}
    for checkpointing in (False, True):
        for name, rows in (("shared", samples), ("whole", whole)):
            policy = copy.deepcopy(model).train()
            if checkpointing:
                policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            positions: list[int] = []
            prefix_passes: list[tuple[int, ...]] = []
            policy.get_decoder().register_forward_pre_hook(_pass_counter(positions, prefix_passes), with_kwargs=True)
            module = EMPO2Module(policy, tok, cfg.algo, cfg.trainer, RolloutBuffer(rows))
            batch = collate(rows, module.pad_id)
            logp = module.response_logprobs(batch)
            (logp * batch["response_mask"]).sum().backward()
            grads = {n: p.grad for n, p in policy.named_parameters() if p.requires_grad}
            assert all(g is not None for g in grads.values())
            runs[checkpointing, name] = logp, grads, sum(positions), sorted(prefix_passes)
    mask = batch["response_mask"]
    logp, grads, positions, prefix_passes = runs[True, "shared"]
    assert prefix_passes == [(1, 11), (1, 17)] and positions < runs[True, "whole"][2]
    assert positions == runs[False, "shared"][2]
    assert not lora or all("lora_" in n for n in grads)
    for other in (runs[False, "shared"], runs[True, "whole"], runs[False, "whole"]):
        torch.testing.assert_close(logp[mask], other[0][mask], rtol=1e-5, atol=1e-5)
        for n, g in grads.items():
            assert_same_gradient(g, other[1][n])


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_under_gradient_checkpointing_shared_prefixes_backpropagate_pass_by_pass(lora):
    """Where checkpointing trades time for memory, a shared prefix no longer keeps the graph whole: each pass
    backpropagates on its own into leaves in place of the prefixes' keys and values, the prefix passes last, and
    every trained parameter gets the gradient of the whole graph to float32 rounding."""
    model, tok = load_policy(ModelConfig(name="tiny", lora_r=4 if lora else 0, lora_dropout=0.0))
    cfg = load_config(["model=tiny"])
    samples = _shared_prefix_samples(model.config.vocab_size)
    grads, stages = {}, []
    for staged in (False, True):
        policy = copy.deepcopy(model).train()
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        module = EMPO2Module(policy, tok, cfg.algo, cfg.trainer, RolloutBuffer(samples))
        batch = collate(samples, module.pad_id)
        passes = [] if staged else None
        (module.response_logprobs(batch, passes=passes) * batch["response_mask"]).sum().backward()
        if staged:
            stages = list(passes)
            module.backward_passes(passes)
            assert not passes
        grads[staged] = {n: p.grad for n, p in policy.named_parameters() if p.requires_grad}
    prefix_ends, prefix_leaves = stages[0]  # appended first, run last
    assert len(stages) >= 3 and len(prefix_ends) == len(prefix_leaves) > 0
    assert all(len(outputs) == 1 for outputs, _ in stages[1:])  # then one stage per pass: its logits
    for name, whole in grads[False].items():
        assert_same_gradient(grads[True][name], whole)


def test_passes_backpropagated_one_by_one_hand_each_gradient_to_grad_and_change_nothing(policy):
    """Rows hundreds of tokens apart run in separate passes. Backpropagated as one graph, each parameter's
    gradient waits in the autograd engine until the last pass that used it is done (a second full set of
    gradients beside `.grad`); pass by pass (`backward_passes`) it reaches `.grad` after every pass. The
    gradient is the same to float32 rounding, and without checkpointing a shared prefix keeps the graph whole."""
    model, tok = policy
    cfg = load_config(["model=tiny", "algo.kl_coef=0"])
    g = torch.Generator().manual_seed(2)
    samples = [StepSample(behaviour_ids=prompt, train_ids=prompt, response_ids=[5 + i, 6, 7][:1 + i], memory=False,
                          offpolicy=False, group_id=0, traj_id=i, step=0, advantage=float(i) - 1.0)
               for i, prompt in enumerate(torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist()
                                          for n in (12, 700, 1500))]
    micro = plan_epoch([len(s.response_ids) for s in samples], 1, len(samples), None,
                       torch.Generator().manual_seed(0))[0][0]
    module = EMPO2Module(model, tok, cfg.algo, cfg.trainer, RolloutBuffer(samples))
    module.buffer.old_logprobs = module.old_logprobs(samples, 4)
    accumulated = dict.fromkeys(model.parameters(), 0)

    def count(p):
        accumulated[p] += 1

    handles = [p.register_post_accumulate_grad_hook(count) for p in model.parameters()]
    grads, counts = [], []
    try:
        for passes in (None, []):
            model.zero_grad()
            accumulated.update(dict.fromkeys(accumulated, 0))
            loss, _, _ = module.micro_batch_loss(micro, passes)
            n_passes = len(passes or [])
            loss.backward()
            module.backward_passes(passes)
            assert not passes  # all run
            grads.append([p.grad.clone() for p in model.parameters()])
            counts.append((n_passes, set(accumulated.values())))
        # without checkpointing a shared prefix ties the passes together: nothing is cut from the graph
        shared = [dataclasses.replace(s, prefix_len=6) for s in samples]
        module.buffer = RolloutBuffer(shared)
        module.buffer.old_logprobs = module.old_logprobs(shared, 4)
        kept: list = []
        module.micro_batch_loss(micro, kept)
    finally:
        for h in handles:
            h.remove()
        model.zero_grad()
    assert counts == [(0, {1}), (3, {3})]  # once per parameter in one graph; once per pass, pass by pass
    assert kept == []
    for whole, by_pass in zip(*grads):
        torch.testing.assert_close(by_pass, whole, rtol=1e-5, atol=1e-7)


def test_old_logprobs_are_the_sampling_distribution_at_the_rollout_temperature(policy):
    """What the engine sampled from, softmax(logits / T), read off `generate`'s processed scores, must be
    what the trainer takes as behaviour log-probs."""
    model, tok = policy
    engine = HFEngine(model, tok)
    params = SamplingParams(temperature=0.7, max_new_tokens=6, stop_at_newline=False)
    prompt = torch.randint(3, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                             generation_config=engine._generation_config(params), output_scores=True,
                             return_dict_in_generate=True)
    response = out.sequences[0, prompt.shape[1]:].tolist()
    sampled = torch.stack([torch.log_softmax(s[0].float(), -1)[t] for s, t in zip(out.scores, response)])
    sample = StepSample(behaviour_ids=prompt[0].tolist(), train_ids=prompt[0].tolist(), response_ids=response,
                        memory=False, offpolicy=False, group_id=0, traj_id=0, step=0)
    cfg = load_config(["model=tiny"])
    module = EMPO2Module(model, tok, cfg.algo, cfg.trainer, RolloutBuffer([sample]), temperature=0.7)
    torch.testing.assert_close(module.old_logprobs([sample], 1)[0], sampled, rtol=1e-5, atol=1e-5)
    at_t1 = EMPO2Module(model, tok, cfg.algo, cfg.trainer, RolloutBuffer([sample])).old_logprobs([sample], 1)[0]
    assert (at_t1 - sampled).abs().max() > 1e-3  # scoring at T = 1 would judge another distribution


def test_generation_logprobs_are_the_scoring_pass_to_float_rounding(policy):
    """Real rollouts, half of them memory-augmented and updated off-policy, sampled with top-p 0.8 at
    temperature 0.7: the log-probs `generate` recorded are those a separate pass scores on the *behaviour*
    prompt (tips included) over the whole vocabulary, to float32 rounding, and they are what the update uses."""
    from empo2.memory import Embedder

    from .test_collector import collect, fill_memory, make_collection

    model, tok = policy
    worker, spec = make_collection(policy, Embedder(), p=0.5, q=1.0, min_sim=-1.0, temperature=0.7, top_p=0.8,
                                   record_logprobs=True, exact_logprobs=True)
    fill_memory(worker)
    samples = collect(worker, spec).samples
    assert any(s.offpolicy for s in samples) and not all(s.offpolicy for s in samples)
    cfg = load_config(["model=tiny"])
    module = EMPO2Module(model, tok, cfg.algo, cfg.trainer, RolloutBuffer(samples), temperature=0.7)
    recorded = [torch.tensor(s.behaviour_logprobs) for s in samples]
    assert [len(r) for r in recorded] == [len(s.response_ids) for s in samples]
    scored = module.score_behaviour(samples, 4)
    worst = max(float((r - p).abs().max()) for r, p in zip(recorded, scored))
    assert worst <= 1e-5
    assert all(torch.equal(o, r) for o, r in zip(module.old_logprobs(samples, 4), recorded))
    at_t1 = EMPO2Module(model, tok, cfg.algo, cfg.trainer, RolloutBuffer(samples)).score_behaviour(samples, 4)
    assert max(float((r - p).abs().max()) for r, p in zip(recorded, at_t1)) > 1e-3  # the check can fail


class FirstStep(L.Callback):
    """The actor metrics of the first optimiser step of the run."""

    def __init__(self):
        self.metrics = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.metrics is None and "actor/ratio_mean" in pl_module.last_step:
            self.metrics = dict(pl_module.last_step)


@pytest.mark.parametrize("overrides", [["trainer.precision=bf16-mixed"],
                                       ["rollout.temperature=0.7", "rollout.generation_logprobs=false"]],
                         ids=["bf16-mixed", "temperature-0.7"])
def test_first_mini_batch_ratio_is_exactly_one_on_policy(tmp_path, overrides, monkeypatch):
    """Old and new log-probs of on-policy samples under the same weights, precision and temperature: the
    first step's ratio is 1 and its KL 0, to the bit (one sample per micro-batch, so shapes match too).
    bf16-mixed keeps the scoring pass although generation log-probs are on by default: `generate` runs
    outside the autocast, so its log-probs are not the update's."""
    scored = _count_scored(monkeypatch)
    rec = FirstStep()
    cfg = load_config(FAST + overrides + ["algo.p=0", "trainer.iterations=1", "trainer.mini_batch_size=64",
                                          "trainer.micro_batch_size=1", f"run_root={tmp_path}", "run_name=r"])
    train(cfg, callbacks=[rec])
    assert rec.metrics is not None and scored[0] > 0
    # every token's ratio is exactly 1; the mini-batch mean weighs micro-batches by token share in float64,
    # which can leave one ulp (a precision or temperature mismatch moves it by 1e-4 or more)
    assert rec.metrics["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-12)
    assert rec.metrics["actor/approx_kl"] == 0.0
    assert rec.metrics["actor/clip_frac"] == 0.0


def _count_scored(monkeypatch) -> list[int]:
    """[samples the update scored on their behaviour prompts itself], counted around the real pass."""
    count = [0]
    real = EMPO2Module.score_behaviour

    def counted(self, samples, micro_batch_size):
        count[0] += len(samples)
        return real(self, samples, micro_batch_size)

    monkeypatch.setattr(EMPO2Module, "score_behaviour", counted)
    return count


def test_first_ratio_with_generation_logprobs_is_one_to_float_rounding(tmp_path, monkeypatch):
    """The default: behaviour log-probs come from `generate` (no scoring pass), and differ from the update's
    own scores only by float32 rounding, far inside the clip range (a temperature mismatch moves the ratio
    by 1e-2 or more, see the test above)."""
    scored = _count_scored(monkeypatch)
    rec = FirstStep()
    cfg = load_config(FAST + ["rollout.temperature=0.7", "algo.p=0", "trainer.iterations=1",
                              "trainer.mini_batch_size=64", "trainer.micro_batch_size=1", f"run_root={tmp_path}",
                              "run_name=r"])
    train(cfg, callbacks=[rec])
    assert rec.metrics is not None and scored[0] == 0
    assert rec.metrics["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert 0.0 <= rec.metrics["actor/approx_kl"] < 1e-10
    assert rec.metrics["actor/clip_frac"] == 0.0


# the update's settings before the laptop-memory defaults: whole micro-batches, activations kept, shared prefixes
# run once
OLD_UPDATE = ["trainer.gradient_checkpointing=false", "trainer.micro_batch_tokens=null", "trainer.release_memory=false"]


class UpdateProbe(L.Callback):
    """What the update ran: micro-batches, the positions its decoder passes ran, each optimiser step's (clipped)
    gradient and actor metrics, and whether the policy recomputes its activations."""

    def __init__(self):
        self.micro_batches, self.positions, self.grads, self.steps, self.checkpointing = 0, 0, [], [], None

    def on_train_start(self, trainer, pl_module):
        self.checkpointing = pl_module.policy.is_gradient_checkpointing

        def count(_, args, kwargs):
            self.positions += (kwargs["input_ids"] if "input_ids" in kwargs else args[0]).numel()

        pl_module.policy.get_decoder().register_forward_pre_hook(count, with_kwargs=True)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append({n: p.grad.clone() for n, p in pl_module.policy.named_parameters()})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.micro_batches += 1
        if batch.last:
            self.steps.append(dict(pl_module.last_step))


def test_the_laptop_memory_defaults_update_as_the_old_settings_to_float32_rounding(tmp_path):
    """Gradient checkpointing, the 1280-token micro-batch cap and the allocator trim, on by default, against the
    update without them, from the same seed: the same rollouts, and the same gradients, losses and updated weights
    to float32 rounding, though the update ran other passes (more micro-batches, so more prefix passes, layers run
    again in the backward)."""
    runs = {}
    for name, extra in (("old", OLD_UPDATE), ("default", [])):
        probe = UpdateProbe()
        # 4 samples a micro-batch, so the cap (about 4 of these prompts) splits some
        summary = train(load_config(FAST + ["trainer.iterations=1", "trainer.micro_batch_size=4",
                                            f"run_root={tmp_path}", f"run_name={name}", *extra]), callbacks=[probe])
        runs[name] = probe, summary
    (old, old_summary), (new, new_summary) = runs["old"], runs["default"]
    assert not old.checkpointing and new.checkpointing
    assert new.micro_batches > old.micro_batches  # the cap cut mini-batches the count left whole
    # a shared prefix runs once per micro-batch with rows that start with it, with or without checkpointing: more
    # micro-batches run more prefix passes (8703 positions against 8279; 9943 when checkpointing ran rows whole)
    assert old.positions < new.positions

    def rollouts(summary):
        return [{k: v for k, v in h.items() if k.startswith("rollout/")} for h in summary["history"]]

    assert rollouts(old_summary) == rollouts(new_summary) and len(old.grads) == len(new.grads) > 1
    for a, b in zip(old.grads, new.grads):  # float32 sums in another order: 1e-5 of the largest entry
        scale = max(float(g.abs().max()) for g in a.values())
        assert max(float((a[n] - b[n]).abs().max()) for n in a) <= 5e-5 * scale
    for a, b in zip(old.steps, new.steps):  # a mean of terms of order 1 (advantage x ratio) that mostly cancel
        assert b["actor/loss"] == pytest.approx(a["actor/loss"], abs=1e-6)
    wa, wb = (_weights(s["checkpoint"]) for s in (old_summary, new_summary))
    # AdamW's first step moves a weight by about lr (1e-3) whatever its gradient's size, so rounding in a
    # gradient near zero shows here at a few percent of one step, 3e-5 (measured: 6e-6)
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) <= 3e-5
    assert any(not torch.equal(wa[k], wb[k]) for k in wa)  # rounding differs: the two updates did run other passes


class StepMeans(L.Callback):
    """Each optimiser step's actor metrics, and what the loggers receive per iteration."""

    def __init__(self):
        self.steps, self.logged = [], []

    def on_train_epoch_start(self, trainer, pl_module):
        self.steps.append([])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch.last:
            self.steps[-1].append(dict(pl_module.last_step))

    def on_train_epoch_end(self, trainer, pl_module):
        self.logged.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def test_each_iteration_logs_the_mean_of_its_optimiser_steps(tmp_path):
    """Metrics reach the loggers once per iteration: the mean over its optimiser steps, each weighing the same."""
    rec = StepMeans()
    train(load_config(FAST + ["trainer.mini_batch_size=3", f"run_root={tmp_path}", "run_name=r"]), callbacks=[rec])
    assert len(rec.logged) == 2
    for steps, logged in zip(rec.steps, rec.logged):
        assert len(steps) >= 2  # a mean of several steps
        for key in ("actor/loss", "actor/ratio_mean", "actor/clip_frac", "actor/approx_kl"):
            mean = sum(s[key] for s in steps) / len(steps)
            assert logged[key] == pytest.approx(mean, rel=1e-6, abs=1e-9), key
        assert logged["train/skipped_steps"] == 0.0 and logged["train/lr"] > 0


class OwnWeightsEngine(HFEngine):
    """An engine that, like vLLM, samples from its own copy of the weights, and records the weights each
    `generate` call and each sync saw."""

    events: list[tuple[str, str]] = []

    def __init__(self, model, tokenizer):
        super().__init__(copy.deepcopy(model), tokenizer)

    def update_weights(self, named_tensors):
        self.model.load_state_dict(dict(named_tensors))
        self.events.append(("sync", state_fingerprint(self.model)))

    def generate(self, prompts, params, seed=None):
        self.events.append(("generate", state_fingerprint(self.model)))
        return super().generate(prompts, params, seed)


def test_an_engine_with_its_own_weights_samples_from_the_restored_policy_after_resume(tmp_path, monkeypatch):
    import empo2.lit.callbacks as callbacks

    monkeypatch.setattr(callbacks, "engine_for", lambda cfg, model, tok: OwnWeightsEngine(model, tok))
    # rollouts of five steps reach different states: nonzero advantages, so the weights move
    args = FAST + ["trainer.iterations=2", "env.max_steps=5", f"run_root={tmp_path}",
                   "run_name=r", "trainer.val_every=5"]
    first = train(load_config(args), callbacks=[StopAfter(1)])
    sd = torch.load(first["checkpoint"], map_location="cpu", weights_only=True)["state_dict"]
    restored, _ = load_policy(ModelConfig(name="tiny"))
    restored.load_state_dict({k.removeprefix("policy."): v for k, v in sd.items()})
    initial = state_fingerprint(load_policy(ModelConfig(name="tiny"))[0])
    assert state_fingerprint(restored) != initial
    OwnWeightsEngine.events = []
    train(load_config(args + ["resume=auto"]))
    first_generate = next(fp for kind, fp in OwnWeightsEngine.events if kind == "generate")
    assert first_generate == state_fingerprint(restored)


def test_a_bfloat16_update_logs_the_gap_every_iteration_and_a_float32_one_has_none_by_construction(tmp_path, capsys):
    """bf16-mixed: HF generates under the update's autocast, the scoring pass runs, and every iteration logs
    rollout/logprob_gap_* (the closing report averages them); 32-true with the engine at float32: the engine's
    log-probs are the old ones and the report says the gap is 0 by construction."""
    from empo2.cli import print_report

    args = FAST + ["trainer.val_every=5", f"run_root={tmp_path}"]
    bf16 = train(load_config(args + ["trainer.precision=bf16-mixed", "run_name=bf16"]))
    gaps = [h for h in bf16["history"] if "rollout/logprob_gap_mean" in h]
    assert [h["iteration"] for h in gaps] == [0, 1] and not bf16["logprobs_exact"]
    assert all(0 < h["rollout/logprob_gap_mean"] <= h["rollout/logprob_gap_max"] and h["rollout/logprob_gap_kl"] > 0
               for h in gaps)
    fp32 = train(load_config(args + ["trainer.iterations=1", "run_name=fp32"]))
    assert fp32["logprobs_exact"] and not any("rollout/logprob_gap_mean" in h for h in fp32["history"])
    print_report(bf16)
    print_report(fp32)
    out = capsys.readouterr().out
    assert "sampler/trainer gap |log pi_old - log pi_engine| per token: mean" in out
    assert "sampler/trainer gap: 0 by construction" in out


@pytest.mark.parametrize("sliding", [False, True], ids=["full_attention", "sliding_window"])
def test_prefixes_are_shared_only_where_a_cache_layer_is_plain_keys_and_values(sliding):
    """A sliding-window layer's cache keeps more than keys and values: no prefix is shared there, with or without
    gradient checkpointing; full attention shares, each layer a row per row asked for."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from empo2.models.prefix_cache import PrefixCaches

    config = Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_sliding_window=sliding, sliding_window=8,
                         max_window_layers=0)
    model = Qwen2ForCausalLM(config).train()
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        caches = PrefixCaches(model.get_decoder(), [(1, 2, 3), (4, 5, 6), (1, 2, 3)], torch.device("cpu"))
        assert caches.ok is not sliding
        if not sliding:
            past = caches.rows([(4, 5, 6), (1, 2, 3), (4, 5, 6)], grow=False)
            assert past.get_seq_length() == 3 and [layer.keys.shape[0] for layer in past.layers] == [3, 3]

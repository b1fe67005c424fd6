"""`grouped_sdpa`: grouped key/value heads read in place under a mask on a CPU, the numbers of transformers'
own "sdpa" (which copies them), with the real tiny policy."""

import copy

import pytest
import torch
import transformers.integrations.sdpa_attention as hf_sdpa

from empo2.config import ModelConfig
from empo2.models import load_policy
from empo2.models.attention import GROUPED_SDPA, grouped_sdpa


@pytest.fixture(scope="module")
def policy():
    return load_policy(ModelConfig(name="tiny"))


def test_grouped_heads_under_a_mask_match_the_copied_heads():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 5, 8, generator=g)  # (B, heads, q, d)
    k, v = torch.randn(3, 2, 9, 8, generator=g), torch.randn(3, 2, 9, 8, generator=g)  # 2 key/value heads
    mask = torch.rand(3, 1, 5, 9, generator=g) > 0.3
    mask[..., 0] = True  # every query sees at least one key
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    ours, _ = grouped_sdpa(module, q, k, v, mask, scaling=0.3)
    stock, _ = hf_sdpa.sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    assert ours.shape == (3, 5, 4, 8)
    torch.testing.assert_close(ours, stock, rtol=1e-6, atol=1e-6)


def test_the_policy_reads_grouped_heads_in_place_with_the_same_logits(policy, monkeypatch):
    model, _ = policy
    assert model.config._attn_implementation == GROUPED_SDPA
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    stock = copy.deepcopy(model)
    stock.set_attn_implementation("sdpa")
    copies = []
    real = hf_sdpa.repeat_kv
    monkeypatch.setattr(hf_sdpa, "repeat_kv", lambda x, n: copies.append(n) or real(x, n))
    ids = torch.randint(3, model.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :4] = mask[1, :7] = 0  # left padding: a mask reaches the attention
    with torch.no_grad():
        ours = model(input_ids=ids, attention_mask=mask).logits
        assert not copies
        theirs = stock(input_ids=ids, attention_mask=mask).logits
        assert copies
    real_rows = mask.bool()
    torch.testing.assert_close(ours[real_rows], theirs[real_rows], rtol=1e-5, atol=1e-5)

"""Scaled dot-product attention that reads grouped key/value heads in place on a CPU.

transformers' "sdpa" copies every key/value head once per query head of its group (`repeat_kv`: the whole
cache, at every layer and step) whenever an attention mask is passed, because CUDA's fused kernels cannot
take grouped heads and a mask together. Torch's CPU kernel can (`enable_gqa`). Generation always passes a mask,
and so do the passes that attend to a shared prefix's cache, where the copies cost a decode step a large share
of its time for equal outputs (docs/performance.md, "Costs behind the code"). `load_policy` selects it in place of
"sdpa"; masks are built as for "sdpa", and every other case (a
GPU, no mask, one key/value head per query head) runs transformers' own "sdpa" function.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

GROUPED_SDPA = "empo2_grouped_sdpa"


def grouped_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 **kwargs) -> tuple[torch.Tensor, None]:
    """query (B, heads, q, d), key/value (B, kv heads, k, d), mask (B, 1, q, k) or None -> (B, q, heads, d)."""
    if (attention_mask is None or query.device.type != "cpu" or key.shape[1] == query.shape[1]
            or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None  # (B, q, heads, d)


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)


def use_grouped_sdpa(model) -> None:
    """Switch a model that runs transformers' "sdpa" to `grouped_sdpa` (others are left as they are)."""
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(GROUPED_SDPA)

"""Tip memory: policy-written tips, their embeddings, retrieval, and the prompt block that carries them.

The package owns `TipMemory` (an hnswlib index, its records and their lifecycle), the sentence embedder and the tip
sanitiser. May import `empo2.config`, `empo2.utils` and `empo2.algo`; models, rollout, lit and workflows sit above
it."""

from .embedder import Embedder
from .records import TipRecord
from .tip_memory import TipMemory
from .tips import (
    TIP_HEADER,
    episode_entries,
    format_tip_block,
    sanitize_tip,
    step_entry_text,
    strip_tip_block,
    tip_request_message,
)

__all__ = [
    "TIP_HEADER",
    "Embedder",
    "TipMemory",
    "TipRecord",
    "episode_entries",
    "format_tip_block",
    "sanitize_tip",
    "step_entry_text",
    "strip_tip_block",
    "tip_request_message",
]

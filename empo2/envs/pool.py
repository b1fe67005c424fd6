"""A pool of started environments, reused across episodes.

A ScienceWorld env owns a JVM that is slow to start and holds memory (docs/performance.md), so rollout workers
borrow started envs instead of building one per episode. `acquire` hands out an idle env (restarting it
first if its JVM died while idle) or builds a new one; `release` takes it back for the next
episode; `close` kills every env the pool built, lent out or not.

Works with any registered env; the liveness check and restart are used when the env has them
(`alive()` / `restart()`, as `ScienceWorldTextEnv` does).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from empo2.envs.base import TextEnv, make_env


class EnvPool:
    """Started `make_env(name, **env_kwargs)` environments kept for reuse. Thread-safe.

    Args:
        name: registered environment name.
        max_idle: most idle envs kept; one released beyond that is closed (None: keep all).
        **env_kwargs: passed to `make_env` for every env the pool builds.
    """

    def __init__(self, name: str = "scienceworld", max_idle: int | None = None, **env_kwargs: Any) -> None:
        if max_idle is not None and max_idle < 0:
            raise ValueError(f"max_idle must be >= 0 or None, got {max_idle}")
        self.name = name
        self.max_idle = max_idle
        self.env_kwargs = env_kwargs
        self._lock = threading.Lock()
        self._idle: list[TextEnv] = []
        self._all: list[TextEnv] = []  # every env built and not yet closed, idle or lent out
        self._closed = False
        self.built = 0  # envs (JVMs) built by this pool
        self.restarted = 0  # idle envs found dead and restarted on acquire

    def prestart(self, n: int) -> None:
        """Build envs until `n` are idle (start JVMs ahead of the first rollout)."""
        while True:
            with self._lock:
                self._check_open()
                if len(self._idle) >= n:
                    return
            env = self._build()
            with self._lock:
                self._idle.append(env)

    def acquire(self) -> TextEnv:
        """An env ready for `reset`: an idle one (restarted if its JVM died) or a new one."""
        with self._lock:
            self._check_open()
            env = self._idle.pop() if self._idle else None
        if env is None:
            return self._build()
        alive = getattr(env, "alive", None)
        if alive is not None and not alive():
            env.restart()  # type: ignore[attr-defined]
            with self._lock:
                self.restarted += 1
        return env

    def release(self, env: TextEnv) -> None:
        """Give an env back for reuse (its episode need not be finished: `reset` starts anew)."""
        with self._lock:
            if not any(e is env for e in self._all):
                raise ValueError("this env was not acquired from this pool (or was already closed)")
            if any(e is env for e in self._idle):
                raise ValueError("this env was already released")
            keep = not self._closed and not getattr(env, "closed", False) and (
                self.max_idle is None or len(self._idle) < self.max_idle)
            if keep:
                self._idle.append(env)
                return
            self._all = [e for e in self._all if e is not env]
        env.close()

    @contextmanager
    def lease(self) -> Iterator[TextEnv]:
        """`with pool.lease() as env:` acquire, and release however the block ends."""
        env = self.acquire()
        try:
            yield env
        finally:
            self.release(env)

    def close(self) -> None:
        """Close every env the pool built, including those still lent out. Idempotent."""
        with self._lock:
            self._closed = True
            envs, self._all, self._idle = self._all, [], []
        for env in envs:
            env.close()

    def __len__(self) -> int:
        """Number of live envs the pool built (idle and lent out)."""
        with self._lock:
            return len(self._all)

    @property
    def idle(self) -> int:
        with self._lock:
            return len(self._idle)

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _build(self) -> TextEnv:
        env = make_env(self.name, **self.env_kwargs)
        with self._lock:
            if not self._closed:
                self._all.append(env)
                self.built += 1
                return env
        env.close()
        raise RuntimeError("this EnvPool was closed while an env was starting")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this EnvPool is closed")

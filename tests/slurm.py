"""A real one-node SLURM cluster for the cluster tests: Debian's `slurmctld`, `slurmd` and `munge`, started
here with a `slurm.conf` written into a temp folder and stopped afterwards. No mocks.

The daemons need root (slurmd starts every job as its owner) and a munge key. Every address stays on the
loopback, pinned in the config (`SlurmctldHost=NAME(127.0.0.1)`, `NodeAddr=127.0.0.1`) rather than taken
from what the host name resolves to, and the ports are free ones, so a cluster already running on the
machine is left alone. Process tracking is `proctrack/linuxproc` and tasks are not bound (`task/none`):
no cgroups, which a container often lacks. As root under CI, or with `EMPO2_INSTALL_SLURM=1`, missing
packages are installed with apt (as `.ci/run` does).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.services import free_port

PACKAGES = ("slurmctld", "slurmd", "munge", "slurm-client")
BINARIES = {"slurmctld": "slurmctld", "slurmd": "slurmd", "munged": "munge", "sbatch": "slurm-client",
            "squeue": "slurm-client", "sinfo": "slurm-client", "scancel": "slurm-client"}
PARTITION = "debug"
# `--launcher slurm` arguments of the tests: two jobs at once on a two-core node, each with a short limit
JOBS = [f"launcher.partition={PARTITION}", "launcher.cpus_per_task=1", "launcher.time=10"]
UNAVAILABLE = "EMPO2_SLURM_UNAVAILABLE"  # set by .ci/run when apt-get could not install the packages


def _sbin(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def missing_parts() -> list[str]:
    """The binaries (and their Debian package) not found on this machine."""
    return [f"{b} ({pkg})" for b, pkg in BINARIES.items() if _sbin(b) is None]


def install() -> str | None:
    """apt-get the packages when allowed (root, and CI or EMPO2_INSTALL_SLURM=1); None on success, else why not."""
    if not missing_parts():
        return None
    if os.environ.get(UNAVAILABLE) == "1":
        return f"the SLURM packages could not be installed on this machine ({', '.join(missing_parts())} missing)"
    if os.geteuid() != 0 or not (os.environ.get("CI") == "true" or os.environ.get("EMPO2_INSTALL_SLURM") == "1"):
        return f"SLURM is not installed ({', '.join(missing_parts())}); as root set EMPO2_INSTALL_SLURM=1 to install it"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    done = subprocess.run(["apt-get", "install", "-y", "-qq", *PACKAGES], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        return f"apt-get install {' '.join(PACKAGES)} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}"
    return None


@dataclass
class Slurm:
    """One running cluster: `env` holds SLURM_CONF for every client command (sbatch, squeue, submitit)."""

    root: Path
    name: str
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict:
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *cmd: str, check: bool = True) -> str:
        done = subprocess.run(list(cmd), capture_output=True, text=True, env={**os.environ, **self.env}, timeout=60)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip() or done.stdout.strip()}")
        return done.stdout

    def queue(self) -> dict[str, str]:
        """job id -> state, of every job the controller still knows."""
        lines = self.run("squeue", "-h", "-o", "%i %T").split()
        return dict(zip(lines[::2], lines[1::2]))

    def stop(self) -> None:
        # jobs first: each runs under its own slurmstepd, which outlives slurmd and would keep its job running
        if len(self.procs) == 3 and all(p.poll() is None for p in self.procs):
            jobs = list(self.queue())
            if jobs:
                self.run("scancel", "--full", *jobs, check=False)
                deadline = time.monotonic() + 30
                while self.queue() and time.monotonic() < deadline:
                    time.sleep(0.5)
        for p in reversed(self.procs):  # slurmd, slurmctld, munged
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        shutil.rmtree(self.root, ignore_errors=True)


def _conf(root: Path, name: str, cpus: int) -> str:
    ctld, node = free_port(), free_port()
    return f"""\
ClusterName=empo2test
SlurmctldHost={name}(127.0.0.1)
SlurmctldPort={ctld}
SlurmdPort={node}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
ReturnToService=2
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
MinJobAge=300
KillWait=5
InactiveLimit=0
NodeName={name} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName={PARTITION} Nodes={name} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


def _start_munge(root: Path) -> subprocess.Popen:
    """A private munged (own key, socket and pid file), so a system munge is left alone."""
    import pwd

    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    munge = pwd.getpwnam("munge")
    (root / "munge").mkdir()
    for p in (root / "munge", key):
        os.chown(p, munge.pw_uid, munge.pw_gid)
    key.chmod(0o400)
    (root / "munge").chmod(0o700)
    sock = root / "munge" / "munge.socket"
    proc = subprocess.Popen(["runuser", "-u", "munge", "--", _sbin("munged"), "--foreground", "--force",
                             f"--key-file={key}", f"--socket={sock}", f"--pid-file={root / 'munge' / 'munged.pid'}",
                             f"--log-file={root / 'munge' / 'munged.log'}", f"--seed-file={root / 'munge' / 'seed'}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 20
    while not sock.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"munged did not start: {(root / 'munge' / 'munged.log').read_text(errors='replace')}")
        time.sleep(0.1)
    return proc


def start_slurm(timeout: float = 60.0) -> Slurm:
    """A fresh one-node cluster in a new temp folder; its node idle and accepting jobs on return."""
    if os.geteuid() != 0:
        raise RuntimeError("a SLURM cluster needs root (slurmd runs each job as its owner)")
    missing = missing_parts()
    if missing:
        raise RuntimeError(f"SLURM is not installed: {', '.join(missing)}")
    root = Path(tempfile.mkdtemp(prefix="empo2-slurm-"))
    root.chmod(0o755)  # munged (user munge) must reach its own folder below
    name = socket.gethostname().split(".")[0]
    cluster = Slurm(root, name)
    try:
        for sub in ("state", "spool"):
            (root / sub).mkdir()
        cluster.procs.append(_start_munge(root))
        cluster.conf.write_text(_conf(root, name, os.cpu_count() or 1))
        # slurm.conf has no MungeSocket key: the daemons and clients find this munged through the plugin's
        # socket option in AuthInfo
        sock = root / "munge" / "munge.socket"
        with open(cluster.conf, "a") as f:
            f.write(f"AuthInfo=socket={sock},cred_expire=10\n")
        env = {**os.environ, **cluster.env}
        for daemon in ("slurmctld", "slurmd"):
            cluster.procs.append(subprocess.Popen([_sbin(daemon), "-D", "-c"] + (["-N", name] if daemon == "slurmd"
                                                                                  else []),
                                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                                                  start_new_session=True))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p, daemon in zip(cluster.procs[1:], ("slurmctld", "slurmd")):
                if p.poll() is not None:
                    log = root / f"{daemon}.log"
                    log = log.read_text(errors="replace") if log.exists() else ""
                    raise RuntimeError(f"{daemon} exited with {p.returncode}: {log[-1500:]}")
            state = cluster.run("sinfo", "-h", "-N", "-o", "%t", check=False).strip()
            if state == "idle":
                return cluster
            time.sleep(0.5)
        raise RuntimeError(f"the SLURM node did not become idle within {timeout:.0f} s")
    except BaseException:
        cluster.stop()
        raise


@pytest.fixture(scope="module", name="slurm")
def slurm_cluster():
    """The cluster, or one line saying why not: a skip, except under CI, where it must start unless the
    package install itself failed (.ci/run says so)."""
    why = install()
    if why is None:
        try:
            cluster = start_slurm()
        except RuntimeError as e:
            why = f"SLURM could not start here: {str(e).splitlines()[0]}"
    if why is not None:
        if os.environ.get("CI") == "true" and os.environ.get(UNAVAILABLE) != "1":
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
    yield cluster
    cluster.stop()

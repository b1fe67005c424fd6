"""A missing real part skips a test with one line outside CI and fails it with that line under CI=true."""

import os
import subprocess
import sys
from pathlib import Path

from tests.real_parts import REAL_PARTS, missing_line

ROOT = Path(__file__).parents[2]
JVM_TEST = "tests/integration/test_scienceworld.py::test_catalogue_is_the_package_split_and_cached"


def path_without(program: str) -> str:
    return os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep) if not (Path(d) / program).exists())


def run_hiding_java(ci: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": path_without("java"), "CI": ci, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "pytest", JVM_TEST, "-q", "-p", "no:cacheprovider"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


def test_every_part_names_itself_and_how_to_get_it(monkeypatch):
    monkeypatch.setenv("PATH", path_without("java"))
    assert missing_line("java") == ("Java (`java` on PATH, ScienceWorld's JVM) is missing "
                                    "(apt-get install default-jre-headless)")
    for part, (name, present, how) in REAL_PARTS.items():
        assert missing_line(part) == (None if present() else f"{name} is missing ({how})")


def test_under_ci_a_missing_java_fails_the_run_in_one_line_naming_it():
    proc = run_hiding_java("true")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-2000:]
    failures = [line for line in out.splitlines() if "is missing" in line]
    assert failures and all("CI=true: Java (`java` on PATH" in line for line in failures), out[-2000:]
    assert "1 error" in out and "skipped" not in out


def test_outside_ci_a_missing_java_skips_with_one_line():
    proc = run_hiding_java("")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "1 skipped" in out, out[-2000:]
    skips = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert len(skips) == 1 and skips[0].endswith("Java (`java` on PATH, ScienceWorld's JVM) is missing "
                                                 "(apt-get install default-jre-headless)"), out[-2000:]

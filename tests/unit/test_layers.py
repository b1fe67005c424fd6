"""The package's imports point one way (docs/architecture.md, "Packages by layer"): `lint-imports` checks the layers
contract in pyproject.toml, function-level imports included, so no import circle can come back unnoticed."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_imports_follow_the_layers_contract():
    script = Path(sys.executable).parent / "lint-imports"  # the venv's own, beside its python
    done = subprocess.run([str(script), "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr

"""Named experiment presets: `experiments/<name>.yaml`, each a list of config overrides.

A preset is the same thing a user types after `empo2 train`, written down once:

    # comment saying what the preset reproduces and why
    base: empo2_paper            # optional: a preset name (or a list) whose overrides come first
    overrides:                   # Hydra overrides, applied in order: later ones win
      - algo.q=0.0

`empo2 train experiment=no_offpolicy algo.p=0.4` expands to the preset's overrides followed by the
command line's, so anything typed wins over the preset, and the run records `experiment` (also its
MLflow tag `preset`). A value ending in `.yaml` is a path to a preset file (a sweep's best.yaml).
The same files hold the grid definitions (`presets:` instead of `overrides:`, see `empo2.workflows.grid`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from empo2.utils.errors import ConfigError

EXPERIMENTS_DIR = Path(__file__).resolve().parents[2] / "experiments"
PRESET_KEYS = ("base", "overrides")
_EXPERIMENT_OVERRIDE = re.compile(r"^\+?experiment=(.*)$")


def read_yaml(path: str | Path, what: str) -> dict[str, Any]:
    """A YAML mapping as plain Python (OmegaConf's loader: `1e-4` is a float, unlike PyYAML's)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException
    from yaml import YAMLError

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} {path}: no such file")
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except (OmegaConfBaseException, YAMLError) as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return data


def check_keys(data: dict, allowed: tuple[str, ...], path: Path | str) -> None:
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise ConfigError(f"{path}: unknown key {unknown[0]!r} (allowed: {', '.join(allowed)})")


def string_list(value: Any, key: str, path: Path | str) -> list[str]:
    """A YAML list of strings (a lone string counts as a list of one)."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{path}: {key} must be a list of strings")
    return list(value)


def available_presets() -> list[str]:
    """Preset names in experiments/ (grid files, which list presets instead, are left out)."""
    names = []
    for path in sorted(EXPERIMENTS_DIR.glob("*.yaml")):
        try:
            if "presets" not in read_yaml(path, "preset"):
                names.append(path.stem)
        except ConfigError:
            continue  # a broken file is reported when it is used, not while listing the others
    return names


def preset_path(ref: str) -> Path:
    """`grpo` -> experiments/grpo.yaml; a value ending in .yaml/.yml is taken as a path."""
    if ref.endswith((".yaml", ".yml")):
        path = Path(ref).expanduser()
        if not path.is_file():
            raise ConfigError(f"experiment={ref}: no such preset file")
        return path
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", ref):
        raise ConfigError(f"experiment={ref!r}: expected a preset name or a path ending in .yaml")
    path = EXPERIMENTS_DIR / f"{ref}.yaml"
    if not path.is_file():
        raise ConfigError(f"experiment={ref}: unknown preset (available: {', '.join(available_presets())})")
    return path


def preset_overrides(ref: str, _stack: tuple[str, ...] = ()) -> list[str]:
    """The full override list of a preset: its bases' overrides (recursively), then its own."""
    if ref in _stack:
        raise ConfigError(f"experiment={_stack[0]}: preset bases form a cycle ({' -> '.join(_stack + (ref,))})")
    path = preset_path(ref)
    data = read_yaml(path, "preset")
    if "presets" in data:
        raise ConfigError(f"{path} is a grid (run it with `empo2 grid {path}`), not a preset")
    check_keys(data, PRESET_KEYS, path)
    out: list[str] = []
    for base in string_list(data.get("base"), "base", path):
        out += preset_overrides(base, _stack + (ref,))
    own = string_list(data.get("overrides"), "overrides", path)
    for o in own:
        if _EXPERIMENT_OVERRIDE.match(o.lstrip("+")):
            raise ConfigError(f"{path}: use `base:` to build on another preset, not {o!r}")
    return out + own


def expand_experiment(overrides: list[str]) -> list[str]:
    """Put the overrides of the `experiment=...` preset (if any) in front of the others."""
    refs = [m.group(1) for o in overrides if (m := _EXPERIMENT_OVERRIDE.match(o))]
    if not refs:
        return overrides
    if len(refs) > 1:
        raise ConfigError(f"experiment is given {len(refs)} times ({', '.join(refs)}); a run has one preset")
    ref = refs[0].strip("'\"")
    if ref in ("null", "None", ""):  # explicitly no preset: the field's documented default
        return overrides
    rest = [o for o in overrides if not _EXPERIMENT_OVERRIDE.match(o)]
    quoted = ref.replace("\\", "\\\\").replace("'", "\\'")  # Hydra's quoted string: any path survives
    return preset_overrides(ref) + rest + [f"experiment='{quoted}'"]

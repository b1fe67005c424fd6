"""Named experiment presets: Hydra's `experiment` group, read from the top-level experiments/ folder.

A preset is a Hydra config holding what a user would type after `empo2 train`, written down once:

    # @package _global_
    # comment saying what the preset reproduces and why
    description: One line saying what the preset is for   # listed by `empo2 config experiment`
    defaults:
      - /experiment/empo2_paper     # optional: presets it builds on, in order (later ones win)
      - override /env: minisci      # group choices
      - _self_                      # the values below win over those of the presets above
    algo:
      q: 0.0

`empo2 train experiment=no_offpolicy algo.p=0.4`: Hydra composes the preset after every group and after
conf/train.yaml's own values, and applies the command line last, so anything typed wins over the preset. The
run records the preset in `experiment` (also its MLflow tag `preset`) and the preset's `description`.
conf/train.yaml puts the folder on Hydra's search path as `empo2-presets://experiments` (`PresetSource`):
`experiment/<name>` is experiments/<name>.yaml, and a name ending in .yaml is the path of a preset file
(a sweep's best.yaml), relative to the current directory; a defaults entry `/experiment/<name or path>` builds
on another preset from any file. A file in the former format (`base:` and `overrides:`, as sweeps wrote best.yaml
before) is migrated when it is read (`migrate`). Grid definitions live in grids/ (`empo2.workflows.grid`), sweeps in
sweeps/ (`empo2.workflows.sweep_spec`).
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any

from hydra.core.object_type import ObjectType
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import OverrideType
from hydra.core.plugins import Plugins
from hydra.errors import HydraException
from hydra.plugins.config_source import ConfigLoadError, ConfigResult, ConfigSource

from empo2.utils.errors import ConfigError

# The project folder is the nearest one above this module that holds conf/train.yaml: conf/, experiments/,
# grids/ and sweeps/ sit side by side there, wherever the package itself lies within it.
PROJECT_DIR = next((p for p in Path(__file__).resolve().parents if (p / "conf" / "train.yaml").is_file()),
                   Path(__file__).resolve().parent.parent)
EXPERIMENTS_DIR = PROJECT_DIR / "experiments"
GROUP = "experiment"
HEADER = "# @package _global_"
FORMER_KEYS = ("base", "overrides")
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
    """Preset names: the YAML files of experiments/."""
    return sorted(p.stem for p in EXPERIMENTS_DIR.glob("*.yaml"))


def preset_descriptions() -> dict[str, str]:
    """name -> the preset's one-line `description`, read from its own file (what `empo2 config experiment` lists)."""
    out = {}
    for name in available_presets():
        try:
            out[name] = str(read_yaml(EXPERIMENTS_DIR / f"{name}.yaml", "preset").get("description") or "")
        except ConfigError as e:
            out[name] = f"(unreadable: {e})"  # one broken file must not hide the others
    return out


def experiment_override(overrides: list[str]) -> tuple[list[str], str | None]:
    """The overrides for Hydra and the preset they name (None: none). `experiment=null` means no preset, the
    field's documented default; a run has one preset."""
    refs = [m.group(1) for o in overrides if (m := _EXPERIMENT_OVERRIDE.match(o))]
    if len(refs) > 1:
        raise ConfigError(f"experiment is given {len(refs)} times ({', '.join(refs)}); a run has one preset")
    ref = refs[0].strip("'\"") if refs else None
    rest = [o for o in overrides if not _EXPERIMENT_OVERRIDE.match(o)]
    if ref in (None, "null", "None", ""):
        return rest, None
    if ref.endswith((".yaml", ".yml")):
        if not preset_file(ref).is_file():
            raise ConfigError(f"experiment={ref}: no such preset file")
    elif not re.fullmatch(r"[A-Za-z0-9_.-]+", ref):
        raise ConfigError(f"experiment={ref!r}: expected a preset name or a path ending in .yaml")
    elif not preset_file(ref).is_file():
        close = difflib.get_close_matches(ref, available_presets(), n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ConfigError(f"experiment={ref}: unknown preset{hint} (available: {', '.join(available_presets())})")
    quoted = ref.replace("\\", "\\\\").replace("'", "\\'")  # Hydra's quoted string: any path survives
    return rest + [f"experiment='{quoted}'"], ref


def preset_file(name: str, folder: str | Path = EXPERIMENTS_DIR) -> Path:
    """`grpo` -> experiments/grpo.yaml; a name ending in .yaml/.yml is a path (relative: to the current folder)."""
    if name.endswith((".yaml", ".yml")):
        return Path(os.path.abspath(os.path.expanduser(name)))
    return Path(folder) / f"{name}.yaml"


class PresetSource(ConfigSource):
    """Hydra config source `empo2-presets://<folder>` (relative: to the project folder): the folder's YAML files
    as the `experiment` group, and any `experiment/<path>.yaml` as the preset file at that path."""

    def __init__(self, provider: str, path: str) -> None:
        super().__init__(provider=provider, path=path)
        self.folder = PROJECT_DIR / self.path  # an absolute path stays as it is

    @staticmethod
    def scheme() -> str:
        return "empo2-presets"

    def _file(self, config_path: str) -> Path | None:
        group, _, name = config_path.strip("/").partition("/")
        if group != GROUP or not name:
            return None
        return preset_file(name, self.folder)

    def load_config(self, config_path: str) -> ConfigResult:
        from omegaconf import DictConfig, OmegaConf
        from omegaconf.errors import OmegaConfBaseException
        from yaml import YAMLError

        path = self._file(config_path)
        if path is None or not path.is_file():
            raise ConfigLoadError(f"Config not found: {config_path}")
        header = ConfigSource._get_header_dict(path.read_text(encoding="utf-8"))
        try:
            cfg = OmegaConf.load(path)  # unresolved: a value may refer to any key of the composed config
        except (OmegaConfBaseException, YAMLError) as e:
            raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(cfg, DictConfig):
            raise ConfigError(f"{path}: expected a mapping at the top level")
        if "presets" in cfg:
            raise ConfigError(f"{path} is a grid (run it with `empo2 grid {path}`), not a preset")
        if header["package"] is None and set(cfg) & set(FORMER_KEYS):
            cfg, header = migrate(OmegaConf.to_container(cfg), path), {"package": "_global_"}
        elif header["package"] != "_global_":
            raise ConfigError(f"{path}: a preset starts with the line `{HEADER}` (it sets keys of the whole config)")
        return ConfigResult(config=cfg, path=f"file://{path.parent}", provider=self.provider, header=header)

    def available(self) -> bool:
        return self.folder.is_dir()

    def is_group(self, config_path: str) -> bool:
        return config_path.strip("/") in ("", GROUP)

    def is_config(self, config_path: str) -> bool:
        path = self._file(config_path)
        return path is not None and path.is_file()

    def list(self, config_path: str, results_filter: ObjectType | None) -> list[str]:
        if config_path.strip("/") == "":
            return [GROUP] if results_filter in (None, ObjectType.GROUP) else []
        if config_path.strip("/") == GROUP and results_filter in (None, ObjectType.CONFIG):
            return sorted(p.stem for p in self.folder.glob("*.yaml"))
        return []


def register_presets() -> None:
    """Make `empo2-presets://` known to Hydra (idempotent); conf/train.yaml's `hydra.searchpath` uses it."""
    Plugins.instance().register(PresetSource)


def preset_config(bases: list[str], overrides: list[str], description: str | None = None,
                  conf_dir: Path = PROJECT_DIR / "conf"):
    """A preset (a DictConfig; `preset_text` adds the header) composing as the former `base: bases` with
    `overrides:` did: the bases in order, then each group's last choice, then the values in order. The former
    format applied every value after every group choice; Hydra merges a preset after every group: the same."""
    from omegaconf import OmegaConf

    defaults: list[Any] = [f"/{GROUP}/{b}" for b in bases]
    choices: dict[str, str] = {}
    values = OmegaConf.create({"description": description} if description else {})
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        raise ConfigError(f"{str(e).splitlines()[0]}") from None
    for o in parsed:
        key = o.key_or_group
        if o.type == OverrideType.DEL or o.package is not None or o.is_sweep_override():
            raise ConfigError(f"{o.input_line}: a preset holds choices and values only")
        if _EXPERIMENT_OVERRIDE.match(o.input_line.lstrip("+")):
            raise ConfigError(f"{o.input_line}: use `base:` to build on another preset")
        if "." not in key and (conf_dir / key).is_dir():
            choices.pop(key, None)  # the last choice of a group wins, as it did on the command line
            choices[key] = o.value()
        else:
            OmegaConf.update(values, key, o.value(), merge=False, force_add=True)
    defaults += [{f"override /{g}": c} for g, c in choices.items()]
    return OmegaConf.create({"defaults": [*defaults, "_self_"], **OmegaConf.to_container(values)})


def migrate(data: dict, path: Path | str):
    """A preset in the former format (`base:` presets whose overrides come first, then `overrides:`) as the
    Hydra config that composes the same way."""
    check_keys(data, FORMER_KEYS, path)
    bases = string_list(data.get("base"), "base", path)
    try:
        return preset_config(bases, string_list(data.get("overrides"), "overrides", path))
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def preset_text(cfg, comment: str = "") -> str:
    """A preset file's text: the header, `comment` (lines already starting with #), then the config."""
    from omegaconf import OmegaConf

    return f"{HEADER}\n{comment}{OmegaConf.to_yaml(cfg)}"

"""Every validated config field rejects a bad value with one line naming it; unknown keys are rejected.

The cases are derived from the range metadata next to each field in empo2/config/__init__.py (`opt(ge=, gt=, le=,
lt=, choices=, nullable=)`), so a new field is covered the moment it is declared.
"""

import dataclasses

import pytest

from empo2.config import GROUPS, ConfigError, TrainConfig, load_config


def _fields():
    cfg = TrainConfig()
    for group in GROUPS + ("",):
        obj = getattr(cfg, group) if group else cfg
        for f in dataclasses.fields(obj):
            if f.name not in GROUPS:
                yield (f"{group}.{f.name}" if group else f.name), f


def _bad_values(f: dataclasses.Field) -> list[str]:
    """Override values just outside what the field's metadata allows."""
    m = f.metadata
    step = 1 if f.type.startswith("int") else 0.5
    bad = []
    if m["ge"] is not None:
        bad.append(m["ge"] - step)
    if m["gt"] is not None:
        bad.append(m["gt"])
    if m["le"] is not None:
        bad.append(m["le"] + step)
    if m["lt"] is not None:
        bad.append(m["lt"])
    if m["choices"] is not None:
        bad.append("not-a-choice")
    if not m["nullable"]:
        bad.append("null")
    return [str(b) for b in bad]


CASES = [pytest.param(key, bad, id=f"{key}={bad}") for key, f in _fields() for bad in _bad_values(f)]


@pytest.mark.parametrize(("key", "bad"), CASES)
def test_a_bad_value_is_rejected_with_one_line_naming_the_field(key, bad):
    with pytest.raises(ConfigError) as err:
        load_config([f"{key}={bad}"])
    message = str(err.value)
    assert "\n" not in message
    assert key in message, message
    assert "unknown key" not in message, message


@pytest.mark.parametrize("group", GROUPS + ("",))
@pytest.mark.parametrize("prefix", ["", "+"])
def test_unknown_keys_are_rejected(group, prefix):
    key = f"{group}.no_such_field" if group else "no_such_field"
    with pytest.raises(ConfigError) as err:
        load_config([f"{prefix}{key}=1"])
    assert str(err.value).startswith(f"{key}: unknown key") and "\n" not in str(err.value)

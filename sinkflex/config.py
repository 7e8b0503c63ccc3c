"""Typed configuration: one pydantic model per component, validated on load.

Configs are YAML files (configs/). Unknown keys and bad values raise `ConfigError`
with the dotted path of the bad field, e.g. ``rollout.sampling.temperature: Input
should be greater than or equal to 0``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

T = TypeVar("T", bound=BaseModel)


class ConfigError(ValueError):
    """A config file is missing, is not YAML, or has a bad or unknown field."""


class StrictModel(BaseModel):
    """Base of every config section: unknown fields are errors, instances are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


def merge_dicts(base: dict, patch: dict) -> dict:
    """`patch` merged into `base` recursively: nested dicts merge, anything else replaces."""
    out = dict(base)
    for key, value in patch.items():
        out[key] = merge_dicts(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def validate_config(data: Any, model: type[T], source: str = "<config>") -> T:
    """Validates `data` against `model`.

    Raises:
        ConfigError: naming each bad field by its dotted path.
    """
    try:
        return model.model_validate(data)
    except ValidationError as err:
        lines = []
        for e in err.errors():
            path = ".".join(str(p) for p in e["loc"]) or "<root>"
            lines.append(f"  {path}: {e['msg']}")
        raise ConfigError(f"invalid config {source}:\n" + "\n".join(lines)) from None


def load_config(path: str | Path, model: type[T]) -> T:
    """Loads a YAML file into `model`.

    Raises:
        ConfigError: missing file, invalid YAML, or a bad field (named by its dotted path).
    """
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config {path} is a directory, not a YAML file")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as err:
        raise ConfigError(f"config {path} is not UTF-8 text: {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config {path} is not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a YAML mapping of sections, got {type(data).__name__}")
    return validate_config(data, model, source=str(path))

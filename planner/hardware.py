"""The hardware catalog: YAML profiles under hwprofiles/, validated against HardwareProfile at load."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from pydantic import ValidationError

from engine.errors import InputError, from_validation_error, unknown_name_error
from engine.files import load_yaml, profile_folder
from hwprofiles import PROFILE_DIR
from planner.specs import HardwareProfile


def load_profile_file(path: str | Path) -> HardwareProfile:
    """Read and validate one profile; any defect is an InputError naming the file and field."""
    path = Path(path)
    data = load_yaml(path, "hardware")
    if not isinstance(data, dict):
        raise InputError("hardware", str(path), "a profile must be a YAML mapping of fields")
    try:
        return HardwareProfile.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc, path.name) from None


@cache
def hardware_catalog() -> dict[str, HardwareProfile]:
    return profile_folder(PROFILE_DIR, load_profile_file)


def get_hardware(name_or_path: str) -> HardwareProfile:
    """A profile by short name, or from a YAML file path for hardware outside the catalog."""
    profiles = hardware_catalog()
    key = name_or_path.strip().lower()
    if key in profiles:
        return profiles[key]
    if key.endswith((".yaml", ".yml")):
        return load_profile_file(name_or_path)
    raise unknown_name_error("hardware", name_or_path, profiles)

"""Model catalog: HF config.json files of well-known models, addressed by short names.

`resolve_model` also accepts any path to a config.json or to a checkpoint folder holding one.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml

from engine.config import ModelConfig
from engine.errors import InputError, unknown_name_error

CATALOG_DIR = Path(__file__).parent
MODELS_DIR = CATALOG_DIR / "models"


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    file: str
    hf_repo: str
    family: str
    published_total_params_b: float
    published_active_params_b: float | None
    params_source: str
    source: str
    notes: str = ""
    aliases: tuple[str, ...] = ()


@cache
def catalog() -> dict[str, CatalogEntry]:
    index = yaml.safe_load((CATALOG_DIR / "models.yaml").read_text())
    return {
        name: CatalogEntry(
            name=name,
            file=entry["file"],
            hf_repo=entry["hf_repo"],
            family=entry["family"],
            published_total_params_b=float(entry["published_total_params_b"]),
            published_active_params_b=entry.get("published_active_params_b"),
            params_source=entry.get("params_source", ""),
            source=entry.get("source", ""),
            notes=entry.get("notes", ""),
            aliases=tuple(entry.get("aliases", ())),
        )
        for name, entry in index.items()
    }


def resolve_model(name_or_path: str) -> ModelConfig:
    """A catalog short name, a config.json path, or a checkpoint folder -> ModelConfig."""
    entries = catalog()
    key = name_or_path.strip().lower()
    key = next((e.name for e in entries.values() if key in e.aliases), key)
    if key in entries:
        return ModelConfig.from_json_file(MODELS_DIR / entries[key].file, name=key)
    path = Path(name_or_path).expanduser()
    if path.suffix == ".json" or path.is_dir():
        return ModelConfig.from_json_file(path)
    if path.exists():
        raise InputError("model", name_or_path, "a file must be a config.json; give a folder for a checkpoint")
    raise unknown_name_error("model", name_or_path, entries)

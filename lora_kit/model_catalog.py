"""The model catalog shipped in ``lora_kit/catalog/models.json``, read once: ground floor, so that loading a
catalog model (its ``hub_id``) and planning one (:mod:`lora_kit.memory.specs`) read the same file."""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

CATALOG_PATH = Path(__file__).parent / "catalog" / "models.json"


@lru_cache(maxsize=1)
def catalog_file() -> dict:
    """The whole file: ``models`` (name -> config facts, ``hub_id``, ``params``) and ``sources``."""
    return json.loads(CATALOG_PATH.read_text())


def hub_id(name: str) -> str | None:
    """The hub model a catalog name stands for (None for a name not in the catalog)."""
    entry = catalog_file()["models"].get(name)
    return entry.get("hub_id") if isinstance(entry, dict) else None

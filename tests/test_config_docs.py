"""docs/config.md is generated from the schema's field docstrings (tools/config_docs.py): regenerated
here in memory, it must equal the committed file, so the reference cannot drift from dtrain/config.py."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

from dtrain.config import PlanConfig

ROOT = Path(__file__).resolve().parents[1]


def load_generator():
    spec = importlib.util.spec_from_file_location("config_docs", ROOT / "tools" / "config_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_config_md_is_current():
    generator = load_generator()
    expected = generator.generate()
    committed = (ROOT / "docs" / "config.md").read_text()
    assert committed == expected, f"docs/config.md is stale: run `{generator.COMMAND}`"


def leaf_keys(cls: type, prefix: str) -> list[str]:
    keys = []
    for field in dataclasses.fields(cls):
        value = field.default_factory() if field.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(value):
            keys += leaf_keys(type(value), f"{prefix}{field.name}.")
        else:
            keys.append(f"{prefix}{field.name}")
    return keys


def test_every_key_has_a_row():
    text = load_generator().generate()
    for key in leaf_keys(PlanConfig, ""):
        assert f"| `{key}` |" in text, key

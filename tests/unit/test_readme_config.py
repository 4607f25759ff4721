"""The configuration reference (docs/configuration.md) names every field of every
section (controlplane.config is the one place they are defined;
docs/infergate.example.toml gives every default)."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel

from controlplane.config import NodeSettings, Settings

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def _section_models() -> dict[str, type[BaseModel]]:
    out: dict[str, type[BaseModel]] = {"nodes": NodeSettings}
    for name, field in Settings.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out[name] = ann
    return out


def test_every_field_is_in_the_configuration_reference() -> None:
    ref = REFERENCE.read_text(encoding="utf-8")
    missing = [f"{sec}.{f}" for sec, model in _section_models().items()
               for f in model.model_fields
               if not re.search(rf"(?<![\w]){re.escape(f)}(?![\w])", ref)]
    assert missing == [], f"docs/configuration.md lacks {missing}"

"""Every numeric option is bounded on both sides, and a number outside a bound is refused
in one line naming the field (its dotted TOML path) and the bound.

The fields are found by walking the pydantic settings model, so a numeric field added
without bounds fails here by itself."""

from __future__ import annotations

import typing
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from controlplane.config import (
    ConfigError,
    Settings,
    bound_message,
    key_path,
    settings_from_dict,
    unwrap_annotation,
)

#: Smallest valid member of a list of sections (the other fields are checked here).
LIST_ITEMS: dict[str, dict] = {
    "nodes": {"name": "a", "url": "http://127.0.0.1:8000"},
    "cache.semantic_domains": {"min_similarity": 0.9},
}
#: Key of a map entry per map path (a key the map allows).
MAP_KEYS = {"cache.min_similarity_routes": "/v1/chat/completions",
            "deadlines.routes": "/v1/completions"}
_CONSTRAINTS = {"ge": "minimum", "gt": "exclusiveMinimum", "le": "maximum", "lt": "exclusiveMaximum"}


class Case(typing.NamedTuple):
    path: str               # dotted TOML path, as the refusal names it
    steps: tuple            # keys from the document root to the field
    kind: type              # int or float
    bounds: dict[str, float]
    list_root: str | None   # TOML path of the enclosing list of sections, if any


def _bounds(metadata: typing.Iterable[Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in metadata:
        if isinstance(m, FieldInfo):
            out.update(_bounds(m.metadata))
        for attr, name in _CONSTRAINTS.items():
            v = getattr(m, attr, None)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[name] = v
    return out


def _numeric(ann: Any) -> tuple[type | None, list]:
    """(int or float, constraint metadata) of a numeric annotation, else (None, [])."""
    meta: list = []
    while typing.get_origin(ann) is typing.Annotated:
        ann, *extra = typing.get_args(ann)
        meta += extra
    ann = unwrap_annotation(ann)
    while typing.get_origin(ann) is typing.Annotated:
        ann, *extra = typing.get_args(ann)
        meta += extra
    return (ann if ann in (int, float) else None), meta


def numeric_fields(model: type[BaseModel] = Settings, path: str = "", steps: tuple = (),
                   list_root: str | None = None) -> list[Case]:
    """Every int or float field under ``model``, in sections, lists of sections and maps."""
    cases: list[Case] = []
    for name, field in model.model_fields.items():
        where, at = (f"{path}.{name}" if path else name), steps + (name,)
        ann = unwrap_annotation(field.annotation)
        origin = typing.get_origin(ann)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            cases += numeric_fields(ann, where, at, list_root)
        elif origin is list:
            item = unwrap_annotation(typing.get_args(ann)[0])
            if isinstance(item, type) and issubclass(item, BaseModel):
                cases += numeric_fields(item, f"{where}[0]", at + (0,), where)
        elif origin is dict:
            key = MAP_KEYS.get(where, "m")
            value = typing.get_args(ann)[1]
            kind, meta = _numeric(value)
            if kind is not None:
                cases.append(Case(key_path(where, key), at + (key,), kind, _bounds(meta),
                                  list_root))
            elif isinstance(unwrap_annotation(value), type) and issubclass(
                    unwrap_annotation(value), BaseModel):
                cases += numeric_fields(unwrap_annotation(value), key_path(where, key),
                                        at + (key,), list_root)
        else:
            kind, meta = _numeric(field.annotation)
            if kind is not None:
                cases.append(Case(where, at, kind, _bounds([*meta, *field.metadata]), list_root))
    return cases


CASES = numeric_fields()


def _document(case: Case, value: Any) -> dict:
    """The smallest document that sets ``case``'s field to ``value``."""
    doc: dict = {}
    cur: Any = doc
    for i, step in enumerate(case.steps[:-1]):
        nxt = case.steps[i + 1]
        if isinstance(nxt, int):
            item = dict(LIST_ITEMS[case.list_root or ""])
            cur[step] = [item]
            cur = item
        elif isinstance(step, int):
            continue
        else:
            cur = cur.setdefault(step, {})
    cur[case.steps[-1]] = value
    return doc


def _outside(case: Case) -> list[tuple[float, str, float]]:
    """(value outside, bound kind, bound) for each bound of ``case``."""
    out = []
    step = 1 if case.kind is int else None
    for kind, b in case.bounds.items():
        d = step or max(1e-3, abs(b) * 1e-3)
        value = {"minimum": b - d, "maximum": b + d, "exclusiveMinimum": b,
                 "exclusiveMaximum": b}[kind]
        out.append((case.kind(value) if case.kind is int else value, kind, b))
    return out


def test_the_walk_finds_the_fields_of_every_kind_of_place() -> None:
    paths = {c.path for c in CASES}
    assert {"controlplane.poll_interval_s", "scoring.w_queue", "edge.max_tries",
            "nodes[0].weight", "cache.semantic_domains[0].pairs",
            'cache.min_similarity_routes["/v1/chat/completions"]',
            'deadlines.routes["/v1/completions"].request_ms'} <= paths
    assert len(CASES) > 80


@pytest.mark.parametrize("case", CASES, ids=[c.path for c in CASES])
def test_every_numeric_field_has_both_bounds(case: Case) -> None:
    assert {"minimum", "exclusiveMinimum"} & set(case.bounds), f"{case.path}: no lower bound"
    assert {"maximum", "exclusiveMaximum"} & set(case.bounds), f"{case.path}: no upper bound"


@pytest.mark.parametrize("case", CASES, ids=[c.path for c in CASES])
def test_a_number_outside_a_bound_is_refused_in_one_line(case: Case) -> None:
    assert case.bounds
    for value, kind, bound in _outside(case):
        with pytest.raises(ConfigError) as exc:
            settings_from_dict(_document(case, value), "f.toml")
        msg = str(exc.value)
        assert "\n" not in msg, msg
        if case.list_root == "nodes":   # the node list keeps pydantic's words
            assert msg.startswith(f"f.toml: invalid configuration: nodes.0.{case.steps[-1]}: ")
            assert str(bound).rstrip("0").rstrip(".") in msg, msg
        else:
            assert msg == ("f.toml: invalid configuration: "
                           + bound_message(case.path, value, kind, bound))


def test_the_named_example() -> None:
    with pytest.raises(ConfigError) as exc:
        settings_from_dict({"controlplane": {"poll_interval_s": -1}}, "cp.toml")
    assert str(exc.value) == ("cp.toml: invalid configuration: controlplane.poll_interval_s: "
                              "-1 is below the minimum 0.01")
    assert exc.value.fields == ["controlplane.poll_interval_s: -1 is below the minimum 0.01"]


def test_several_refused_fields_are_listed_one_per_line() -> None:
    with pytest.raises(ConfigError) as exc:
        settings_from_dict({"controlplane": {"poll_interval_s": -1},
                            "scoring": {"saturation_kv": 2}}, "cp.toml")
    assert str(exc.value).splitlines() == [
        "cp.toml: invalid configuration:",
        "  controlplane.poll_interval_s: -1 is below the minimum 0.01",
        "  scoring.saturation_kv: 2 is above the maximum 1"]

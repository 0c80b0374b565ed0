"""Model configs as dataclasses read from a checkpoint's JSON: the keys a dataclass declares as its
fields, and the rest kept beside them (its `extra` field), so that a config written back holds every
key it was read with."""

from __future__ import annotations

import copy
from dataclasses import fields
from typing import Any


def _names(cls_or_obj) -> list[str]:
    return [f.name for f in fields(cls_or_obj) if f.name != "extra"]


def split_fields(cls, raw: dict) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the keys of `raw` that `cls` declares as fields, other than `extra`; the rest), deep copies."""
    names = set(_names(cls))
    raw = copy.deepcopy(dict(raw))
    return {k: v for k, v in raw.items() if k in names}, {k: v for k, v in raw.items() if k not in names}


def field_values(obj) -> dict[str, Any]:
    """A config dataclass's fields (not `extra`) by name, deep copies."""
    return {name: copy.deepcopy(getattr(obj, name)) for name in _names(obj)}

"""config_fields: a raw config split into a dataclass's fields and the rest, and written back whole."""

from dataclasses import dataclass, field

from mstar.models.config_fields import field_values, split_fields


@dataclass
class _Config:
    width: int = 1
    sizes: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)


def test_split_and_write_back():
    raw = {"width": 3, "sizes": [1, 2], "unknown": {"a": [1]}, "extra": "a key named extra is not the field"}
    known, rest = split_fields(_Config, raw)
    assert known == {"width": 3, "sizes": [1, 2]}
    assert rest == {"unknown": {"a": [1]}, "extra": "a key named extra is not the field"}
    known["sizes"].append(9)
    rest["unknown"]["a"].append(9)
    assert raw["sizes"] == [1, 2] and raw["unknown"] == {"a": [1]}  # deep copies: raw is untouched
    cfg = _Config(**split_fields(_Config, raw)[0], extra=rest)
    values = field_values(cfg)
    assert values == {"width": 3, "sizes": [1, 2]}
    values["sizes"].append(7)
    assert cfg.sizes == [1, 2]

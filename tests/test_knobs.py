"""The knob table: every knob parses its default, rejects garbage by name, and unknown
MSTAR_* names stop start-up."""

import subprocess
import sys

import pytest

from mstar import knobs


@pytest.mark.parametrize("knob", knobs.KNOBS, ids=lambda k: k.name)
def test_every_knob_has_meaning_and_parses_its_default(knob):
    assert knob.meaning and knob.name.startswith("MSTAR_")
    raw = str(int(knob.default)) if isinstance(knob.default, bool) else str(knob.default)
    assert knob.parse(raw) == knob.default
    assert knobs.parse_environment({})[knob.name] == knob.default


@pytest.mark.parametrize("knob", [k for k in knobs.KNOBS if k.type != "str"], ids=lambda k: k.name)
def test_typed_knobs_reject_garbage_by_name(knob):
    with pytest.raises(knobs.KnobError, match=knob.name):
        knobs.parse_environment({knob.name: "not-a-valid-value"})


def test_unknown_knob_is_rejected():
    with pytest.raises(knobs.KnobError, match="MSTAR_NO_SUCH_KNOB"):
        knobs.parse_environment({"MSTAR_NO_SUCH_KNOB": "1"})


def test_int_minimum_and_bool_forms():
    assert knobs.parse_environment({"MSTAR_PAGE_SIZE": "32"})["MSTAR_PAGE_SIZE"] == 32
    with pytest.raises(knobs.KnobError, match="MSTAR_PAGE_SIZE"):
        knobs.parse_environment({"MSTAR_PAGE_SIZE": "0"})
    for raw, want in [("1", True), ("true", True), ("0", False), ("off", False)]:
        assert knobs.parse_environment({"MSTAR_VERIFY": raw})["MSTAR_VERIFY"] is want


def test_override_is_scoped():
    before = knobs.value("MSTAR_PAGE_SIZE")
    with knobs.override(MSTAR_PAGE_SIZE=7):
        assert knobs.value("MSTAR_PAGE_SIZE") == 7
    assert knobs.value("MSTAR_PAGE_SIZE") == before
    with pytest.raises(knobs.KnobError):
        with knobs.override(MSTAR_NOPE=1):
            pass


def test_changed_names_the_knobs_off_their_defaults():
    flip = next(k for k in knobs.KNOBS if k.type == "bool")
    assert flip.name not in knobs.changed()
    with knobs.override(**{flip.name: not flip.default, "MSTAR_PAGE_SIZE": knobs.value("MSTAR_PAGE_SIZE")}):
        assert knobs.changed().get(flip.name) is (not flip.default)
        assert "MSTAR_PAGE_SIZE" not in knobs.changed()  # set, but to its default
    assert flip.name not in knobs.changed()


def test_cli_prints_table_and_rejects_bad_env():
    out = subprocess.run([sys.executable, "-m", "mstar.runtime.knobs", "--markdown"], capture_output=True,
                         text=True, check=True).stdout
    for k in knobs.KNOBS:
        assert f"`{k.name}`" in out
    bad = subprocess.run([sys.executable, "-m", "mstar.runtime.knobs", "--check"], capture_output=True,
                         text=True, env={"MSTAR_PAGE_SIZE": "x", "PATH": ""})
    assert bad.returncode == 1 and "MSTAR_PAGE_SIZE" in bad.stderr


def test_readme_shows_the_table():
    import pathlib
    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert knobs.format_table(markdown=True) in readme, "regenerate: python -m mstar.runtime.knobs --markdown"

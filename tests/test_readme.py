"""README shows what users look for: every server flag (with its help text) and the commands."""

import pathlib

from mstar.runtime.serving.serve import build_parser
from mstar.runtime.serving.serve_flags import flags_table

README = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_readme_has_every_server_flag():
    assert flags_table(build_parser()) in README, \
        "regenerate README's flag table from mstar.runtime.serving.serve_flags.flags_table(build_parser())"


def test_readme_has_the_two_commands():
    assert "pip install -e . && python -m mstar.runtime.serve" in README
    assert 'pip install -e ".[dev]" && pytest' in README

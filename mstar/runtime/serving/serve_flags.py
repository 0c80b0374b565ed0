"""The server's flags as a markdown table (README shows it; tests/test_readme.py checks it)."""

from __future__ import annotations

import argparse


def flags_table(parser: argparse.ArgumentParser) -> str:
    rows = []
    for a in parser._actions:
        if not a.option_strings or a.dest == "help":
            continue
        flag = max(a.option_strings, key=len)
        default = "" if a.default in (None, False, argparse.SUPPRESS) else f"`{a.default}`"
        meaning = " ".join((a.help or "").replace("%(default)s", str(a.default)).split())
        meaning = meaning.replace("|", "\\|")
        rows.append(f"| `{flag}` | {default} | {meaning} |")
    return "\n".join(rows)

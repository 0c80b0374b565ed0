"""`python -m mstar.runtime.knobs`: print every MSTAR_* knob (the table lives in mstar/knobs.py).

  --markdown   the table as markdown (what README.md shows)
  --check      parse the current environment and exit 1 naming a bad knob
"""

from __future__ import annotations

import argparse
import sys

from mstar.knobs import KnobError, format_table, parse_environment


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mstar.runtime.knobs",
                                 description="Print mstar's MSTAR_* knobs: name, type, default, meaning.")
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown (README's form)")
    ap.add_argument("--check", action="store_true",
                    help="parse the current environment's MSTAR_* variables and report the first bad one")
    args = ap.parse_args(argv)
    if args.check:
        try:
            values = parse_environment()
        except KnobError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        for k, v in values.items():
            print(f"{k}={v!r}")
        return 0
    print(format_table(markdown=args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())

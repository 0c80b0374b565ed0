"""The `mstar` console script.

    mstar serve [flags]        the OpenAI-compatible server (same flags as python -m mstar.runtime.serve)
    mstar bench-serve [flags]  the serving benchmark (same flags as python -m mstar.bench.serve)
"""

from __future__ import annotations

import sys

_USAGE = """usage: mstar <command> [flags]

commands:
  serve        serve a model over an OpenAI-compatible HTTP API (mstar serve --help)
  bench-serve  benchmark an OpenAI-compatible server or HF generate (mstar bench-serve --help)
"""


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_USAGE, end="")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "serve":
        from mstar.runtime.serve import main as serve_main
        return serve_main(rest, prog="mstar serve")
    if cmd in ("bench-serve", "bench_serve"):
        from mstar.bench.serve import main as bench_main
        return bench_main(rest)
    print(f"mstar: unknown command {cmd!r}\n\n{_USAGE}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

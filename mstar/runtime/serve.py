"""`python -m mstar.runtime.serve`: the OpenAI-compatible server (mstar.runtime.serving.serve);
`mstar serve` runs the same."""

from mstar.runtime.serving.serve import main

if __name__ == "__main__":
    raise SystemExit(main())

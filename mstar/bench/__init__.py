"""mstar's benchmarks, in one place (how they measure: notes/benchmarks.md).

    mstar bench serve | whisper | offline | gate | gate-model   the clients (python -m mstar.bench.NAME)
    mstar bench ops [pytest args]                              the op benchmarks (mstar/bench/ops, pytest)
    python -m mstar.bench.tools.NAME                           probes and profilers (mstar/bench/tools)
"""

"""Op benchmarks (pytest-benchmark): every op and every backend available on this machine, checked
against the reference and timed at the served models' shapes.

    mstar bench ops [pytest args]          # = python -m pytest <this folder> [pytest args]
    pytest mstar/bench/ops -k rms_norm     # from a checkout
"""

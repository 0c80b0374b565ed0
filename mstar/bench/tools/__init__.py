"""Probes and profilers beside the benchmarks: where a step's time goes, the server path alone,
phase-timing summaries, the tensor-parallel all-reduce. Each runs as `python -m mstar.bench.tools.NAME`
(`--help` explains it); the shell scripts here run from a checkout.
"""

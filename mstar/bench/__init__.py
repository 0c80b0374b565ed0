"""Benchmarks that run against the whole system (`python -m mstar.bench.serve`); op benches live in bench/."""

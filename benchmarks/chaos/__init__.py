"""Chaos and soak harness (issue 12 item 7): sim agents behind the gateway under seeded load while agents are
killed and restarted, one agent stalls, clients disconnect mid-stream and a few read slowly.

Run from the repository root: `.venv/bin/python -m benchmarks.chaos --help` (docs/chaos.md has the commands,
the categories and how determinism works). Modules: `workload` (seeded requests), `client` (one stream as the
client sees it), `classify` (each stream's verdict), `fleet` (the processes), `faults` (the fault schedule),
`report` (figures), `run` (the order of a run), `__main__` (arguments, JSON output, summary).
A benchmark, not a test: it reports figures and writes JSON; tests/integration/test_chaos.py runs a short
version and asserts the contract.
"""

"""The project's benchmarks, run from the repository root as modules: `python -m benchmarks.apply`,
`python -m benchmarks.real family ...`, `python -m benchmarks.docs` (see `benchmarks/README.md`).

They use only the library's public API and write self-describing JSON under `benchmarks/results/`; the docs pages
under `docs/` are generated from that JSON by `python -m benchmarks.docs`.
"""

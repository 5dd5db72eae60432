"""The project's benchmarks, laid out by study (`benchmarks/<study>/`, each with its run and its report: `switch`,
`sealed`, `ladder`, `repair`, `handoff`, `speed`, `variants`, `gpu`, `real`), run from the repository root as modules:
`python -m benchmarks.speed.apply`, `python -m benchmarks.real family ...`, `python -m benchmarks.docs` (see
`benchmarks/README.md`). The tasks, judges and records migration they build on are the lab's (`lab/`).

They use only the library's public API and write self-describing JSON under `benchmarks/results/`; the docs pages
under `docs/` are generated from that JSON by `python -m benchmarks.docs`.
"""

"""The lab beside the library: what builds the shipped tiny family (`lab.zoo`: training, its scoring, the family's
README), the real-text tasks and the guarded judge the studies score with (`lab.real`), and the migration of ladder
records measured before a field existed (`lab.ladder_migration`).

Not shipped: the wheel carries `hf_kvmap` only (pyproject's `[tool.setuptools.packages.find]`), and the library never
imports this package. Like `benchmarks/`, it calls only the library's public names (`tests/test_architecture.py`).
"""

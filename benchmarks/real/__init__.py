"""The real pair, Qwen2.5-Coder 0.5B <-> 1.5B on real weights and real text: `python -m benchmarks.real`.

Modules: `common` (models, directions, the prefill store, result paths), `calibrate`, `fit`, `evaluate` (evaluate,
analyze, latency) and `family_report` (the real-family study, `family_cli` its commands); `scale` (the scale curve and
its scorer), `finetune` (fine-tunes and feature-fitted variants), `layers` (layer swaps, key geometry), `guard`
(the guarded handoff's probes on real weights) and `scale_report` (the scale study, `scale_cli` its commands); `cli`
joins both under one parser.
"""

"""Timing against the FLOP bound: applying a mapper against the target's re-prefill (`apply`), the fit's cost
(`fit`), the fine-tuning objectives' cost (`objective_costs`) and a fit that moves between machines
(`portable_fit`). Reported in docs/performance.md."""

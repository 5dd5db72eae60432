"""Selective repair on the real pair: the strategies and fractions (`real_repair`), the maps it repairs
(`real_repair_maps`), the attention-based selections (`repair_attention`), its cost (`repair_cost`) and frontier
(`repair_frontier`), and the report (`repair_report`). Reported in docs/repair.md."""

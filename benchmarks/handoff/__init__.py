"""The guarded handoff on the tiny family: every candidate probe's risk, thresholds and net saving
(`handoff`, reported by `handoff_report`), and multi-turn drift of a session (`handoff_session`). Reported in
docs/guard.md."""

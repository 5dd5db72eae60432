"""The real-text tasks the studies of `benchmarks/` build and score: short tasks (`tasks`), long-context ones
(`long_tasks`), whole-context tasks (`context_tasks`: `ruler_tasks`, `code_tasks`, `task_text`), HumanEval
(`humaneval`) and the guarded judge that executes completions (`judge`, its child `judge_child`). The real models,
their calibration text and a pair's map are the library's (`hf_kvmap.real`, `hf-kvmap obtain`, `hf-kvmap pair`)."""

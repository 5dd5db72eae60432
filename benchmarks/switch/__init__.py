"""Whether to switch on a real pair, per task family and length, and through which rung: the long-context switch
(`long_switch`, its arguments and rung syntax `long_switch_args`, the runner that serves every arm of an item
`long_switch_runner` and its report `long_switch_report`), the maps compared under one
protocol (`map_compare`) and the targets a switch must meet (`switch_targets`); the sealed protocols beside it are
`benchmarks.sealed`. Written to `results/long_switch*.json`, reported in docs/switch.md."""

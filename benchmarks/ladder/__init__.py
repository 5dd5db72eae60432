"""The guard ladder: a rung per request calibrated on measured items (`guard_ladder`), how many items a
calibration needs (`ladder_calibration_size`), the headroom a better probe would leave (`ladder_headroom`) and the
ladder per prompt length (`ladder_lengths`). Reported in docs/ladder.md."""

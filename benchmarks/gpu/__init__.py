"""Checks that need a GPU, each with a CPU dry run: the paper's latency table at the real Qwen3 shapes
(`gpu_shapes`) and device placement split over a GPU and the CPU (`gpu_check`)."""

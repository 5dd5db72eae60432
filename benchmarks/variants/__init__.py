"""Choosing the shipped mappers: quality and speed per variant (`mapper_variants`), retention against
parameters (`retention_curve`, `variant_parameters`), which target layer breaks a task (`layer_swap`) and what the
wheel weighs (`package_size`)."""

"""The planner: per-rank memory, communication, pipeline bubble, step time and MFU of a
layout, predicted from the model shape and the run configuration alone, and checked against
what the trainer measures (`train.py --report-comm`; the memory lines at start). See
docs/PLANNING.md for the formulas and tools/plan.py for the command line.

parameters.py: the parameters and buckets of each rank, exact model-state bytes.
memory.py: activations, microbatches in flight, transient buffers, per-rank peak.
communication.py: calls and bytes per group and op of one step; alpha-beta time.
moe.py: mixture of experts: total vs active parameters, FLOPs of the active experts, the
    expert-parallel layout, an MoE layer's activations and its all-to-alls.
context_parallel.py: context parallelism: the CP attention's K/V ring (or all-gather) per
    layer, its transient buffers, the dp x cp gradient group's label.
search.py: every valid layout for a GPU count (ep and cp too), ranked by predicted step time.
report.py: what the trainer logs beside its measurements.
"""

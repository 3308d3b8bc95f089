"""Context parallelism (issue 32): the sequence split over a CP group of ranks.

- layout.py: which tokens a rank holds (2*cp chunks, causal load balance) and their global
  positions.
"""
from .layout import local_positions, split_for_context_parallel  # noqa: F401

"""Context parallelism: the sequence split over a CP group of ranks.

- layout.py: which tokens a rank holds (2*cp chunks, causal load balance) and their global
  positions;
- blocks.py: one block of attention in mergeable parts (online softmax, log-sum-exp; the
  FlashAttention-2 backward) and the plan of blocks that skips fully masked ones;
- ring.py: "p2p", ring attention (K/V travel, the next block's transfer overlapped);
- all_gather.py: "all_gather", one all-gather of K/V (reduce-scatter of dK, dV);
- attention.py: `context_parallel_attention`, the entry that checks and dispatches.
"""
from .attention import COMM_TYPES, context_parallel_attention  # noqa: F401
from .layout import local_positions, split_for_context_parallel  # noqa: F401

"""Context parallelism in the planner: what the CP attention of layers/context_parallel/
exchanges and holds, and the labels of the groups the trainer uses at cp > 1.

A CP rank holds `s_r = s / cp` tokens of each sequence; its attention layer works on
`g_r` KV heads (`g / t`, or 1 when t is a multiple of g: layers/attention.py) of
`d = kv_channels` values, so one K/V block (K and V of the rank's tokens) is
`B = 2 b g_r s_r d` elements.

Communication per layer and microbatch, on each CP rank (ring.py / all_gather.py):

- p2p (ring attention, Liu et al. 2023, "Ring Attention with Blockwise Transformers",
  sec. 3): the forward passes K/V around the ring in `cp - 1` messages of `B e` bytes
  (`e` the activation dtype's size); the backward sends K/V again (`cp - 1` messages of
  `B e`) and the float32 dK/dV accumulators (`cp` messages of `4 B`), the last one bringing
  each block's gradient home. Each message is one `send` and one `recv` of the same size
  (`batch_isend_irecv`, as `train.py --report-comm` counts them).
- all_gather: the forward gathers K/V (`all_gather_single` of the local `B e`); the
  backward gathers them again and reduce-scatters the float32 dK/dV of the whole sequence
  (`reduce_scatter_single` of `4 B cp`).
- recompute: a layer inside a full-recompute span, and every layer under selective
  recompute (its core attention is what is checkpointed), runs the attention forward again
  in backward: one more forward's messages.

Transient memory of one attention call at its peak (the backward), beyond the saved
tensors of planner/activations.py (q, k, v, output, float32 log-sum-exp):

- p2p: the stacked K/V being sent and the one received in flight (`2 B e`), the float32
  dK/dV accumulator of the held block and the one in flight (`2 x 4 B`), float32 dQ
  (`4 b n_r s_r d`), and one key block's float32 scores, probabilities and their gradient
  (`3 x 4 b n_r (s_r) (s_r / 2)`: a block is at most all local queries against one of
  the held rank's two chunks, blocks.plan_blocks).
- all_gather: the gathered K/V of the whole sequence and its reordered copy (`2 B cp e`),
  the float32 dK/dV of the whole sequence and the reduce-scatter's reordered input
  (`2 x 4 B cp`), dQ, and one block's three float32 matrices (`3 x 4 b n_r (s_r / 2) s`:
  a query chunk against every key up to it).

The dense weights' gradients reduce over dp x cp (planner/parameters.py
`gradient_data_parallel_size`); the comm counter labels that group "dp" at cp 1, "cp" at
dp 1 (parallel_state/grid.py reuses the CP group) and "dp-cp" otherwise.
"""
from __future__ import annotations


def gradient_group_label(dp: int, cp: int) -> str:
    """The comm counter's label of the dp x cp group (the gradients', the loss sums')."""
    if cp == 1:
        return "dp"
    return "cp" if dp == 1 else "dp-cp"


def kv_heads_per_rank(model, tp: int) -> int:
    """KV heads a TP rank's attention holds: g / t, or 1 when t is a multiple of g (the
    groups are replicated, layers/attention.py)."""
    g = model.num_query_groups or model.num_attention_heads
    return g // tp if g % tp == 0 else 1


def kv_block_elements(model, seq_length: int, micro_batch_size: int, tp: int, cp: int) -> int:
    """`B = 2 b g_r (s / cp) d`: the elements of one rank's K and V (module docstring)."""
    return 2 * micro_batch_size * kv_heads_per_rank(model, tp) * (seq_length // cp) \
        * model.kv_channels


def layer_communication(model, seq_length: int, micro_batch_size: int, tp: int, cp: int,
                        bytes_per_value: int, comm_type: str = "p2p",
                        recomputed: bool = False) -> dict[tuple[str, str], tuple[int, int]]:
    """`{("cp", op): (calls, bytes)}` of one attention layer and microbatch on one CP rank
    (module docstring), in the quantities the comm counter records (a p2p message: one
    `send` and one `recv` call of its size). `recomputed`: the layer's attention forward
    runs again in backward. Empty at cp 1. Raises ValueError for an unknown comm_type."""
    if comm_type not in ("p2p", "all_gather"):
        raise ValueError(f"--cp-comm-type must be p2p or all_gather, got {comm_type!r}")
    if cp == 1:
        return {}
    blk = kv_block_elements(model, seq_length, micro_batch_size, tp, cp)
    kv, dkv = blk * bytes_per_value, 4 * blk
    forwards = 2 if recomputed else 1
    if comm_type == "p2p":
        calls = forwards * (cp - 1) + (cp - 1) + cp
        nbytes = (forwards + 1) * (cp - 1) * kv + cp * dkv
        return {("cp", "send"): (calls, nbytes), ("cp", "recv"): (calls, nbytes)}
    return {("cp", "all_gather_single"): (forwards + 1, (forwards + 1) * kv),
            ("cp", "reduce_scatter_single"): (1, dkv * cp)}


def ring_bytes_per_step(model, seq_length: int, micro_batch_size: int, tp: int, cp: int,
                        bytes_per_value: int) -> dict[str, int]:
    """Bytes one rank sends in one ring step of one layer (p2p): `{"forward": B e,
    "backward": B e + 4 B}` (K/V, and K/V plus the float32 dK/dV accumulator), the
    figures ring.py documents."""
    blk = kv_block_elements(model, seq_length, micro_batch_size, tp, cp)
    return {"forward": blk * bytes_per_value, "backward": blk * bytes_per_value + 4 * blk}


def attention_buffer_bytes(model, seq_length: int, micro_batch_size: int, tp: int, cp: int,
                           bytes_per_value: int, comm_type: str = "p2p") -> int:
    """Peak transient bytes of one CP attention call on a rank (its backward; module
    docstring). 0 at cp 1 (the fused kernel's workspace is not modelled there either)."""
    if cp == 1:
        return 0
    b, s_r = micro_batch_size, seq_length // cp
    n_r = model.num_attention_heads // tp
    blk = kv_block_elements(model, seq_length, b, tp, cp)
    dq = 4 * b * n_r * s_r * model.kv_channels
    if comm_type == "p2p":
        return 2 * blk * bytes_per_value + 2 * 4 * blk + dq + 3 * 4 * b * n_r * s_r * (s_r // 2)
    return 2 * blk * cp * bytes_per_value + 2 * 4 * blk * cp + dq \
        + 3 * 4 * b * n_r * (s_r // 2) * seq_length

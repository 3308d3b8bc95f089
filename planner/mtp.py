"""Activation bytes of multi-token prediction (models/mtp.py; DeepSeek-V3 technical report,
arXiv:2412.19437, sec. 2.2), term by term, on the last pipeline stage.

`D` depths, `s` tokens, `b` micro batch, `h` hidden, `t` TP, `V_t` the padded vocabulary
over `t`, `e` bytes a value, `s_l` the rows of the norms and replicated linears (`s / t` under
sequence parallelism, else `s`). What a training microbatch saves for backward beyond the
model without MTP, per depth k (measured with training.memory's saved-tensor meter, region
"other": tests/test_planner_mla.py):

- the word-embedding lookup of the shifted tokens t_{i+k} keeps its int64 ids `8 s b` and
  under TP the bool mask of the ids outside the rank's vocabulary shard, `s b` (as the
  first stage's embedding; no embedding dropout);
- enorm, hnorm (eq. 21) and the depth's final norm: one norm each over `s_l b` rows
  (`planner.activations.norm_bytes`); hnorm's input is h^{k-1} itself, which the previous
  depth's final norm (or the model's) made, so nothing is counted twice;
- `eh_proj`'s input, the concatenation `[enorm(emb); hnorm(h)]`: `e s_l b 2h`;
- the transformer layer (eq. 22), numbered `num_layers + k - 1` (an MoE layer when the
  model's last layer is one): `planner.activations.model_layer_bytes` without recompute,
  whatever the run's policy, since --recompute-granularity covers the decoder's layers only
  (layers/recompute.py `apply_recompute`);
- the shared output head (eq. 23) runs once on the main and the D depths' hidden states
  stacked along the batch, so its input (`[s_l, (1 + D) b, h]`, a copy) and the cross
  entropy's float32 softmax, int64 target and two bool masks grow by one batch per depth:
  `e s_l b h + 4 b s V_t + 10 b s`;
- the MTP term of the loss (eq. 24-25, `MultiTokenPrediction.objective`) keeps the depths'
  shifted loss mask (float32 `[b, D, s]`: `4 b s` a depth).

Under context parallelism `s` is a CP rank's part and the layer's attention is
layers/context_parallel's (`model_layer_bytes(context_parallel=True)`).
"""
from __future__ import annotations

from models.config_mtp import mtp_depths

from .activations import model_layer_bytes, norm_bytes


def mtp_activation_bytes(config, s: int, b: int, t: int = 1, sp: bool = False,
                         bytes_per_value: int = 4, keyed_dropout: bool = True,
                         ep: int = 1, context_parallel: bool = False) -> dict:
    """`{term: bytes}` the `mtp_depths(config)` multi-token-prediction depths save for
    backward on one rank of the last stage (module docstring), beyond the model without
    them; `{}` without MTP. `s` tokens, micro batch `b`, TP `t`, `sp` sequence parallel,
    `keyed_dropout` `--dropout-masks sample`, `ep` the expert-parallel size,
    `context_parallel`: `s` is a CP rank's part of the sequence."""
    depths = mtp_depths(config)
    if not depths:
        return {}
    e, h = bytes_per_value, config.hidden_size
    rows = (s // t if sp else s) * b
    vocab = config.padded_vocab_size(t) // t
    layers = sum(sum(model_layer_bytes(
        config, s, b, t, sp, None, e, keyed_dropout=keyed_dropout, ep=ep,
        context_parallel=context_parallel,
        moe=config.is_moe_layer(config.num_layers + k - 1)).values())
        for k in range(1, depths + 1))
    return {"mtp token ids": depths * (8 + (t > 1)) * s * b,
            "mtp norms": depths * 3 * norm_bytes(config, rows, e),
            "mtp eh_proj input": depths * e * rows * 2 * h,
            "mtp transformer layers": layers,
            "mtp output head and loss": depths * (e * rows * h + 4 * b * s * vocab +
                                                  10 * b * s),
            "mtp loss mask": depths * 4 * b * s}

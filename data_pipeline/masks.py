"""Masks and positions for samples that pack several documents (Megatron-LM's
``get_ltor_masks_and_position_ids``, written here vectorized).

A training sample is a window of the token stream, so it may hold the end of one document,
an EOD token and the start of the next. By default the model sees the window as one causal
sequence. The options (Megatron's flags) make documents independent:

- ``reset_attention_mask``: token j may attend to token k <= j only when no EOD lies in
  tokens[k:j] (the EOD itself belongs to the document it ends);
- ``reset_position_ids``: positions restart at 0 after every EOD;
- ``eod_mask_loss``: no loss where the *input* token is EOD (predicting the first token of
  the next document from the EOD).

With all three, a document's tokens get exactly the logits they would get alone.
"""
from __future__ import annotations

import torch


def ltor_masks_and_position_ids(tokens: torch.Tensor, eod: int, reset_position_ids: bool,
                                reset_attention_mask: bool, eod_mask_loss: bool):
    """For input `tokens [b, s]` (int64): `(attention_mask [b, 1, s, s] bool (True = may
    attend) or None for plain causal, loss_mask [b, s] float32, position_ids [b, s] int64 or
    None for 0..s-1)`."""
    b, s = tokens.shape
    is_eod = tokens == eod
    loss_mask = torch.ones(b, s, dtype=torch.float32, device=tokens.device)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    # doc[j]: EODs strictly before j, the index of the document token j belongs to
    doc = torch.cumsum(is_eod.long(), dim=1) - is_eod.long()
    attention_mask = None
    if reset_attention_mask:
        causal = torch.ones(s, s, dtype=torch.bool, device=tokens.device).tril()
        attention_mask = (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]
    position_ids = None
    if reset_position_ids:
        idx = torch.arange(s, device=tokens.device).expand(b, s)
        after_eod = torch.where(is_eod, idx + 1, torch.zeros_like(idx))  # next doc's start
        start = torch.cummax(after_eod, dim=1).values  # inclusive: an EOD starts the next...
        start = torch.cat([torch.zeros(b, 1, dtype=start.dtype, device=start.device),
                           start[:, :-1]], dim=1)  # ...so shift: the EOD keeps its document
        position_ids = idx - start
    return attention_mask, loss_mask, position_ids

"""The data of a run: tokenizer and datasets (GPT windows, or T5 span corruption over them)
and the microbatches of each global batch on this DP rank. Split out of training/trainer.py,
which runs them."""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

import parallel_state as ps
from parallel_state import collectives

from .arguments import Config
from data_pipeline.masks import ltor_masks_and_position_ids
from layers.context_parallel import split_for_context_parallel
from models.config_mtp import mtp_depths
from models.mtp import mtp_shifted


class DataError(ValueError):
    """The data or tokenizer cannot be used as given; raised alike on every rank before any
    training step, with the file and the fix in the message."""


def build_data(config: Config):
    """Tokenizer and train/valid datasets; the embedded default corpus when no --data-path.

    Raises `DataError` for missing/corrupt files, an unusable tokenizer, empty splits, or data
    holding token ids the tokenizer (and so the model's vocabulary) does not have.
    """
    try:
        return _build_data(config)
    except (ValueError, FileNotFoundError) as e:
        raise DataError(str(e)) from None


def check_token_ids(prefixes: list[str], vocab_size: int, limit: int = 1_000_000_000) -> None:
    """Every token id of each dataset must be < vocab_size, or the data was tokenized with
    another tokenizer (ids beyond the vocab would silently embed as zeros at TP > 1).
    Datasets over `limit` tokens are checked on their first `limit` tokens."""
    from data_pipeline import IndexedDataset

    for prefix in prefixes:
        ds = IndexedDataset(prefix)
        if ds.num_tokens == 0:
            continue
        tokens = np.memmap(prefix + ".bin", dtype=ds.dtype, mode="r",
                           shape=(min(ds.num_tokens, limit),))
        top = int(tokens.max())
        if top >= vocab_size:
            raise ValueError(f"{prefix}.bin holds token id {top} but the tokenizer has only "
                             f"{vocab_size} ids: the data was made with another tokenizer; "
                             f"pass the --tokenizer-model used by tools/preprocess_data.py")


def _build_data(config: Config):
    from checkpoint.model_io import verify_stored_tokenizer

    from data_pipeline.data_path import parse_data_path
    from data_pipeline import build_tokenizer, build_train_valid_test_datasets, ensure_default_corpus

    t = config.train
    data_path, tokenizer_path = t.data_path, t.tokenizer_model
    verify_stored_tokenizer(tokenizer_path)  # a checkpoint's: its sha256 before it is parsed
    if not data_path:
        # One process builds (file lock inside), the others wait and reuse the cache. A given
        # tokenizer (e.g. a fine-tuned checkpoint's) tokenizes the corpus itself.
        if dist.get_rank() == 0:
            prefix, tokenizer_path = ensure_default_corpus(tokenizer=tokenizer_path)
        collectives.barrier()
        if dist.get_rank() != 0:
            prefix, tokenizer_path = ensure_default_corpus(quiet=True, tokenizer=tokenizer_path)
        data_path = [prefix]
    tokenizer = build_tokenizer(tokenizer_path)
    config.eod = tokenizer.eod
    check_token_ids([prefix for _, prefix in parse_data_path(data_path)], tokenizer.vocab_size)
    gbs = t.global_batch_size
    # every evaluation reads the same first eval_iters global batches of the valid split
    num_samples = (t.train_iters * gbs, t.eval_iters * gbs if t.eval_interval else 0, 0)
    if not config.model.is_encoder_decoder:
        train_ds, valid_ds, _ = build_train_valid_test_datasets(
            data_path, t.split, config.model.seq_length, t.seed, num_samples)
        return tokenizer, train_ds, valid_ds
    return (tokenizer, *_t5_datasets(config, tokenizer, data_path, num_samples))


def vocab_extra_ids(config: Config) -> int:
    """Sentinel ids a T5 model embeds above the tokenizer's (--vocab-extra-ids, 100 by
    default as T5); 0 for GPT."""
    if not config.model.is_encoder_decoder:
        return 0
    return 100 if config.train.vocab_extra_ids is None else config.train.vocab_extra_ids


def _t5_datasets(config: Config, tokenizer, data_path, num_samples):
    """Span-corrupted (train, valid) over GPT windows of the raw length the encoder fits."""
    from data_pipeline import build_train_valid_test_datasets
    from data_pipeline.t5_dataset import T5SpanCorruptionDataset, span_corruption_lengths

    t, m = config.train, config.model
    raw, _ = span_corruption_lengths(m.seq_length, t.noise_density, t.mean_noise_span_length)
    windows = build_train_valid_test_datasets(data_path, t.split, raw - 1, t.seed, num_samples)
    pad = tokenizer.pad if tokenizer.pad >= 0 else 0
    kw = dict(encoder_seq_length=m.seq_length, decoder_seq_length=m.decoder_seq_length,
              vocab_size=tokenizer.vocab_size + vocab_extra_ids(config),
              num_sentinels=vocab_extra_ids(config), eos_id=tokenizer.eod, pad_id=pad,
              seed=t.seed, noise_density=t.noise_density,
              mean_noise_span_length=t.mean_noise_span_length)
    return [None if w is None else T5SpanCorruptionDataset(w, **kw) for w in windows[:2]]


def get_microbatches(dataset, base: int, config: Config, device,
                     global_batch_size: int | None = None) -> list[dict]:
    """This DP rank's microbatches of the global batch that starts at sample `base`.

    The global batch (`global_batch_size`, default --global-batch-size; smaller during
    --rampup-batch-size) holds samples [base, base + gbs) (`base` is the data position, the
    consumed samples, so a changed --global-batch-size neither repeats nor skips one);
    within each chunk of mbs*dp samples, DP rank r takes [r*mbs, (r+1)*mbs) (Megatron's
    pretraining sampler), so the set of samples in a step does not depend on the layout.
    Each microbatch also holds `sample_ids` `[mbs]`, those samples' indices (dropout's key).
    Under context parallelism (cp > 1) every `[mbs, s]` field (tokens, labels, loss mask,
    position ids) holds this CP rank's load-balanced part `[mbs, s/cp]`
    (`layers.context_parallel.split_for_context_parallel`); the model takes the global
    positions of those tokens from the grid when the batch has no position ids. With
    multi-token prediction (D = --mtp-num-layers) the microbatch also holds `mtp_tokens`,
    `mtp_labels` and `mtp_loss_mask` `[mbs, D, s]` (models/mtp.py `mtp_shifted`), shifted on
    the whole sequence before the CP split, so each rank's part needs nothing of another's.
    """
    t = config.train
    mbs, dp, dp_rank = t.micro_batch_size, config.data_parallel_size, ps.get_data_parallel_rank()
    gbs = global_batch_size or t.global_batch_size
    packed = t.reset_position_ids or t.reset_attention_mask or t.eod_mask_loss
    cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    depths = mtp_depths(config.model)
    out = []
    for m in range(gbs // (mbs * dp)):
        start = base + m * mbs * dp + dp_rank * mbs
        # the global indices of the samples: what keys their dropout masks (layers/dropout.py)
        sample_ids = torch.arange(start, start + mbs, dtype=torch.int64)
        if config.model.is_encoder_decoder:  # span-corrupted T5 samples (dicts)
            items = [dataset[start + j] for j in range(mbs)]
            batch = {k: torch.from_numpy(np.stack([it[k] for it in items])) for k in items[0]}
            out.append({"tokens": batch["text_enc"], "encoder_mask": batch["enc_mask"],
                        "labels": batch["labels"], "loss_mask": batch["loss_mask"],
                        "sample_ids": sample_ids})
            out[-1] = {k: v.to(device) for k, v in out[-1].items()}
            continue
        samples = np.stack([dataset[start + j] for j in range(mbs)]).astype(np.int64)
        tokens = torch.from_numpy(samples)
        batch = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                 "loss_mask": torch.ones(mbs, tokens.shape[1] - 1), "sample_ids": sample_ids}
        if packed:  # --reset-position-ids / --reset-attention-mask / --eod-mask-loss
            mask, batch["loss_mask"], positions = ltor_masks_and_position_ids(
                batch["tokens"], config.eod, t.reset_position_ids, t.reset_attention_mask,
                t.eod_mask_loss)
            batch.update({k: v for k, v in (("attention_mask", mask),
                                             ("position_ids", positions)) if v is not None})
        if depths:  # multi-token prediction: the depths' shifts of the whole sequences
            batch.update(mtp_tokens=mtp_shifted(batch["tokens"], depths, 0),
                         mtp_labels=mtp_shifted(batch["labels"], depths, -100),
                         mtp_loss_mask=mtp_shifted(batch["loss_mask"], depths, 0))
        if cp > 1:  # this CP rank's chunks r and 2cp-1-r of every sequence
            for k in ("tokens", "labels", "loss_mask", "position_ids"):
                if k in batch:
                    batch[k] = split_for_context_parallel(batch[k], 1, cp, cp_rank)
            for k in ("mtp_tokens", "mtp_labels", "mtp_loss_mask"):
                if k in batch:  # [mbs, D, s]
                    batch[k] = split_for_context_parallel(batch[k], 2, cp, cp_rank)
        out.append({k: v.to(device) for k, v in batch.items()})
    return out

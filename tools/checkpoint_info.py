"""Print a checkpoint's iteration, layout, model, files and verification status.

    python tools/checkpoint_info.py runs/ckpt                  # the checkpoint `latest` names
    python tools/checkpoint_info.py runs/ckpt/iter_0000010     # one checkpoint folder
    python tools/checkpoint_info.py runs/ckpt --no-checksums   # sizes only (fast)

Exit code 0 when the checkpoint is complete and every file matches metadata.json (size and
sha256), its model fits in the shard files and matches the tensors `.metadata` lists, 1
otherwise (the problems are printed, each naming the file and the fix). The folder is read as
untrusted input (checkpoint/safe_dcp.py): `.metadata` is unpickled only after its sha256
matched, and only into DCP's metadata classes.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from checkpoint.format import (CONFIG, LATEST, CheckpointError,  # noqa: E402
                                        complete_checkpoints, debris, resolve_checkpoint,
                                        summarize)


def moe_line(m: dict) -> str:
    """The `experts:` line of metadata.json's model `m` (an MoE model): experts per MoE
    layer and which layers, routing, widths, and how they are stored. `m` is untrusted: a
    field of the wrong type or size is shown as written (the status lines say what is wrong)."""
    from models.config import ModelConfig

    layers = f"moe_layer_freq {m.get('moe_layer_freq')!r}"
    try:
        config = ModelConfig.from_dict(m)
        if config.num_layers <= 1000:
            layers = "layers " + ", ".join(str(n) for n in range(config.num_layers)
                                           if config.is_moe_layer(n))
    except Exception:  # noqa: BLE001 - any field of the wrong type or size
        pass
    shared = m.get("moe_shared_expert_intermediate_size")
    return (f"experts: {m.get('num_moe_experts')} per MoE layer ({layers}), "
            f"top-{m.get('moe_router_topk')} {m.get('moe_router_score_function')}, "
            f"expert ffn {m.get('moe_ffn_hidden_size')}"
            + (f", shared experts ffn {shared}" if shared else "")
            + (", expert bias" if m.get("moe_router_enable_expert_bias") else "")
            + "; stored one tensor per expert (any --expert-model-parallel-size loads it)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path", help="a --save folder or one iter_XXXXXXX checkpoint folder")
    p.add_argument("--no-checksums", action="store_true", help="check sizes, not sha256")
    p.add_argument("--show-config", action="store_true", help="print config.yaml too")
    args = p.parse_args(argv)
    try:
        path = resolve_checkpoint(args.path)
    except CheckpointError as e:
        print(f"checkpoint: {args.path}\nstatus: BAD\n  {e}")
        return 1
    if path is None:
        print(f"checkpoint: {args.path}\nstatus: BAD\n  no {LATEST} and no checkpoint folder")
        return 1
    root = os.path.dirname(os.path.normpath(path))
    others = [os.path.basename(q) for _, q in complete_checkpoints(root)]
    meta, problems = summarize(path, checksums=not args.no_checksums)
    print(f"checkpoint: {path}")
    if meta is not None:
        lay, m = meta["layout"], meta["model"]
        total = sum(f["bytes"] for f in meta["files"])
        print(f"iteration: {meta['iteration']} (consumed samples {meta.get('consumed_samples')})")
        print("layout: " + " ".join(f"{k}={v}" for k, v in lay.items()))
        print(f"model: {m.get('name') or 'custom'}: layers {m.get('num_layers')}, hidden "
              f"{m.get('hidden_size')}, heads {m.get('num_attention_heads')} (kv "
              f"{m.get('num_query_groups')}), ffn {m.get('ffn_hidden_size')}, vocab "
              f"{m.get('vocab_size')}, {m.get('position_embedding_type')}/"
              f"{m.get('normalization')}/{m.get('activation')}")
        if m.get("num_moe_experts"):
            print(moe_line(m))
        print(f"files: {len(meta['files'])}, {total:,} bytes; torch {meta.get('torch_version')}")
        if os.path.basename(os.path.normpath(path)) in others:  # one of a --save folder's
            print(f"checkpoints in {root}: {' '.join(others)}")
        else:  # e.g. tools/convert_hf.py import's output
            print("a standalone checkpoint folder (not an iter_XXXXXXX of a --save folder)")
        left = [os.path.basename(q) for q in debris(root)]
        if left:
            print(f"debris (interrupted saves; the next run's start-up or --keep-last removes "
                  f"them): {' '.join(left)}")
        if args.show_config and os.path.isfile(os.path.join(path, CONFIG)):
            print(open(os.path.join(path, CONFIG)).read())
    if problems:
        print("status: BAD")
        for msg in problems:
            print(f"  {msg}")
        return 1
    print("status: OK" + (" (sizes only)" if args.no_checksums else " (sizes and sha256)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

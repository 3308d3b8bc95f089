"""What the entry points say while they start: infer.py's loading steps on rank 0 only (other
ranks' transformers progress bars kept quiet), the speculative decoding line, the demo
corpus's tokenizing progress, and the shared rate-limited progress log."""
from __future__ import annotations

import os
import subprocess
import sys

from launch import REPO


def test_progress_log_is_rate_limited():
    """Nothing before `first` seconds, then at most one line every `every` seconds; the
    line's function is called only for a line said; `say` None says nothing."""
    from checkpoint.progress import ProgressLog, format_duration

    now, said, made = [0.0], [], []

    def line(elapsed):
        made.append(elapsed)
        return f"at {format_duration(elapsed)}"

    log = ProgressLog(said.append, first=5.0, every=15.0, clock=lambda: now[0])
    for _ in range(100):  # one call per second for 100 s
        now[0] += 1.0
        log(line)
    assert said == ["at 00:05", "at 00:20", "at 00:35", "at 00:50", "at 01:05", "at 01:20",
                    "at 01:35"]
    assert len(made) == len(said)
    quiet = ProgressLog(None, first=0.0, clock=lambda: now[0])
    assert quiet("x") is False
    assert format_duration(3723) == "1:02:03" and format_duration(-3) == "00:00"


def test_infer_says_what_it_loads_on_rank_0_only(tmp_path):
    """`torchrun --nproc-per-node 2 infer.py --hf tiny.gguf --tp 2`: rank 0 says each step
    (the GGUF header, the model's size, de-quantizing, the weights, the tokenizer, the engine,
    speculative decoding) once and in order; transformers' de-quantizing bar shows once
    (rank 0's), not interleaved with rank 1's. Before: nothing until the bars of both ranks,
    and no line saying speculative decoding was on."""
    from gguf_files import tiny_gguf
    from test_finetune import _tokenizer

    tok = str(tmp_path / "tokenizer")
    _tokenizer(tok, open(os.path.join(os.path.dirname(os.__file__), "textwrap.py")).read())
    _, gguf_path, _ = tiny_gguf("qwen3", tmp_path, tok)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", "infer.py", "--hf", gguf_path, "--tp", "2", "--prompt", "hello there",
         "--max-new-tokens", "3", "--max-model-len", "64", "--max-batch-size", "2",
         "--num-speculative-tokens", "2"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = proc.stderr.replace("\r", "\n")
    steps = ["] reading the GGUF metadata of " + gguf_path,
             "] loading qwen3 from " + gguf_path + " (gguf): 2 layers, hidden 64, heads 4/2",
             "] de-quantizing the tensors of qwen3.gguf (transformers)",
             "] copying the weights into this rank's share (tp 2, pp 1)",
             "] loading the tokenizer of " + gguf_path,
             "] building the engine (KV cache)",
             "] KV cache: ",
             "] speculative decoding on: ngram, k 2 (prompt lookup of 2..4-token suffixes)"]
    where = []
    for step in steps:
        assert err.count(step) == 1, (step, err[-3000:])
        where.append(err.index(step))
    assert where == sorted(where), err[-3000:]
    bars = [ln for ln in err.splitlines() if ln.startswith("Converting and de-quantizing")]
    assert bars and sum("100%|" in ln for ln in bars) == 1, bars
    assert where[2] < err.index("Converting and de-quantizing") < where[3]

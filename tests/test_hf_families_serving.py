"""`infer.py --serve --hf FOLDER` over a tiny random Hugging Face model of the 2025 families,
with a trained 400-id BPE tokenizer in the folder, under torchrun on loopback, answering the
official `openai` client with greedy output equal to transformers' `generate`:

- Gemma 3 (local sliding-window layers of window 8 interleaved with global ones, two RoPE
  bases) at --tp 2 --pp 2 (one world of 4: both stages hold a local and a global layer);
- Qwen3-MoE (4 experts, top 2, sliding window 6) at --tp 2 --enable-expert-parallel (two
  whole experts a rank);

each with prompts as token ids (three in one request, decoded together past the window) and
as text, streamed and not.

One launch per model; the generated ids come back through `logprobs` (each token's bytes name
its id), the text is compared too.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from distributed import free_port
from launch import OWN_PROCESS_GROUP, REPO, read_until

MAX_TOKENS = 24
ID_PROMPTS = [[5, 17, 99, 3, 42, 8], [7, 31, 250], [200, 100, 9, 11]]
TEXT_PROMPTS = ["def wrap(text, width", "import re"]


def _gemma3(folder: str, text: str) -> None:
    """test_hf_gemma's tiny Gemma 3 (4 layers, sliding 0 and 2, global 1 and 3), eos = the
    tokenizer's </s> (2) as a real model's config says, with the tokenizer saved beside it."""
    from test_finetune import _tokenizer
    from test_hf_gemma import _hf_configs, _perturb
    from transformers import AutoModelForCausalLM

    cfg = _hf_configs()["gemma3"]
    cfg.bos_token_id, cfg.eos_token_id = 1, 2
    torch.manual_seed(40)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        _perturb(model)
    model.save_pretrained(folder)
    _tokenizer(folder, text)
    _byte_level_decoder(folder)


def _byte_level_decoder(folder: str) -> None:
    """Give test_finetune's tokenizer (saved in `folder`) the byte-level decoder of its
    byte-level pre-tokenizer, so that text decodes as a released BPE tokenizer's does."""
    from tokenizers import Tokenizer, decoders

    path = os.path.join(folder, "tokenizer.json")
    tok = Tokenizer.from_file(path)
    tok.decoder = decoders.ByteLevel()
    tok.save(path)


def _qwen3_moe(folder: str, text: str) -> None:
    """test_hf_moe_families' tiny Qwen3-MoE (4 experts, top-2 renormalised, per-head q/k
    norms, layer 0 dense, sliding window 6 on every layer), its norms and biases random as
    there, eos = </s> (2), the tokenizer beside it."""
    from test_finetune import _tokenizer
    from test_hf_moe_families import _hf_configs
    from transformers import AutoModelForCausalLM

    cfg = _hf_configs()["qwen3_moe"]
    cfg.bos_token_id, cfg.eos_token_id = 1, 2
    torch.manual_seed(33)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if "norm" in pname else 0.0, 0.1)
    model.save_pretrained(folder)
    _tokenizer(folder, text)
    _byte_level_decoder(folder)


# name -> (builder, infer.py's parallel flags, world size)
MODELS = {"gemma3": (_gemma3, ["--tp", "2", "--pp", "2"], 4),
          "qwen3_moe": (_qwen3_moe, ["--tp", "2", "--enable-expert-parallel"], 2)}


@pytest.fixture(scope="module", params=list(MODELS))
def served(request, tmp_path_factory):
    """(name, HF folder, port) of a running `infer.py --serve` of one model; stopped (SIGTERM
    through torchrun) after the module's tests of it."""
    name = request.param
    build, flags, world = MODELS[name]
    folder = str(tmp_path_factory.mktemp("serving") / name)
    build(folder, open(os.path.join(os.path.dirname(os.__file__), "textwrap.py")).read())
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={world}", os.path.join(REPO, "infer.py"), "--hf", folder, *flags,
           "--serve", "--host", "127.0.0.1", "--port", str(port), "--served-model-name", name,
           "--max-batch-size", "4"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            **OWN_PROCESS_GROUP)
    try:
        lines = []
        read_until(proc, lines, f"serving {name} on")
        pp = flags[flags.index('--pp') + 1] if '--pp' in flags else 1
        ep = ", ep=2" if "--enable-expert-parallel" in flags else ""
        assert f"(dp=1, tp=2, pp={pp}{ep})" in lines[-1], lines[-1]  # the grid asked for
        yield name, folder, port
    finally:
        proc.send_signal(signal.SIGTERM)  # torchrun forwards it to the workers
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _hf_greedy(hf, prompt: list[int]) -> list[int]:
    """transformers' greedy ids after `prompt` (its generation_config's eos ends them)."""
    x = torch.tensor([prompt])
    out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS,
                      do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_greedy_completions_equal_transformers_generate(served):
    import openai
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.tokenizer import Tokenizer
    from test_server import _token_bytes

    name, folder, port = served
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                           timeout=120, max_retries=0)
    ours = Tokenizer(folder)
    by_bytes = {ours.token_bytes(i): i for i in range(ours.vocab_size)}
    assert len(by_bytes) == ours.vocab_size  # every token its own bytes: ids from the text

    def ids_of(choice) -> list[int]:
        return [by_bytes[_token_bytes(t)] for t in choice.logprobs.tokens]

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    # three id prompts in one request: decoded side by side (4 slots)
    out = client.completions.create(model=name, prompt=ID_PROMPTS, max_tokens=MAX_TOKENS,
                                    temperature=0, logprobs=1)
    assert [c.index for c in out.choices] == list(range(len(ID_PROMPTS)))
    lengths = []
    for prompt, choice in zip(ID_PROMPTS, out.choices):
        want = _hf_greedy(hf, prompt)
        assert len(set(want)) > 4, want  # not one repeated id
        assert ids_of(choice) == want, f"{name}: greedy ids after {prompt} differ from HF's"
        assert choice.text == tok.decode(want, skip_special_tokens=True), name
        assert choice.finish_reason == ("length" if len(want) == MAX_TOKENS else "stop")
        lengths.append(len(want))
    assert out.usage.completion_tokens == sum(lengths)
    assert max(lengths) + max(map(len, ID_PROMPTS)) > 2 * 8  # well past the window of 8
    # text prompts, each its own request, streamed and not
    for text in TEXT_PROMPTS:
        prompt = tok(text, add_special_tokens=False)["input_ids"]
        want = _hf_greedy(hf, prompt)
        one = client.completions.create(model=name, prompt=text, max_tokens=MAX_TOKENS,
                                        temperature=0, logprobs=1)
        assert one.usage.prompt_tokens == len(prompt), (text, one.usage)
        assert ids_of(one.choices[0]) == want, f"{name}: greedy ids after {text!r} differ"
        assert one.choices[0].text == tok.decode(want, skip_special_tokens=True)
        chunks = list(client.completions.create(model=name, prompt=text, temperature=0,
                                                max_tokens=MAX_TOKENS, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == one.choices[0].text, text

"""Serving many LoRA adapters over one base (infer.py --enable-lora; inference/lora.py,
layers/multi_lora.py, models/hf/peft_adapter.py): real PEFT adapters made with `peft` on tiny
transformers Llama / Qwen3 models; a mixed batch of 3 adapters + base gives each request the
greedy ids it gets alone and peft's; tp 2 and pp 2 the same ids; the prefix cache is not
shared across adapters; hostile adapter folders refused with one-line errors."""
from __future__ import annotations

import functools
import json
import os
import shutil

import pytest
import torch

from distributed import free_port, run_distributed
from launch import OWN_PROCESS_GROUP, read_until
from test_data import hf_tokenizer_dir

pytest.importorskip("peft")

NEW = 6
PROMPTS = [[5, 17, 99, 3, 42, 8, 9, 10, 11], [7, 1, 2, 3, 4, 5, 6, 8], [200, 100, 3],
           [11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [31, 32, 33], [50, 51, 52, 53, 54, 55],
           [60, 61], [70, 71, 72, 73]]
# request i runs with adapter ADAPTER_OF[i] (None: the base)
ADAPTER_OF = ["a", "b", None, "c", "a", "b", "c", None]


def _config(kind: str):
    from transformers import LlamaConfig, Qwen3Config

    common = dict(vocab_size=400, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, num_hidden_layers=2, max_position_embeddings=64,
                  initializer_range=0.2, bos_token_id=None, eos_token_id=None,
                  tie_word_embeddings=False)
    if kind == "qwen3":
        return Qwen3Config(head_dim=16, **common)
    return LlamaConfig(**common)


def _make_adapter(base: str, out: str, seed: int, r: int, targets, alpha: int, rslora=False):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                                                  lora_dropout=0.0, use_rslora=rslora))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:  # lora_B starts at zero: make both halves matter
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    peft_model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lora")
    out = {}
    for i, kind in enumerate(("llama", "qwen3")):
        torch.manual_seed(i)
        path = str(root / kind)
        AutoModelForCausalLM.from_config(_config(kind)).save_pretrained(path)
        out[kind] = path
    hf_tokenizer_dir(out["llama"], [open(os.__file__).read()])  # for the server's text
    base = out["llama"]
    out["a"] = _make_adapter(base, str(root / "a"), 1, 4, ["q_proj", "v_proj"], 8)
    out["b"] = _make_adapter(base, str(root / "b"), 2, 8, "all-linear", 16, rslora=True)
    out["c"] = _make_adapter(base, str(root / "c"), 3, 2, ["o_proj", "down_proj", "up_proj"],
                             4)
    out["q"] = _make_adapter(out["qwen3"], str(root / "q"), 4, 4, "all-linear", 8)
    return out


def _peft_greedy(base: str, adapter: str | None, prompt: list[int]) -> list[int]:
    """peft's greedy ids for `prompt` (computed once per base, adapter and prompt)."""
    return list(_peft_greedy_cached(base, adapter, tuple(prompt)))


@functools.lru_cache(maxsize=None)
def _peft_greedy_cached(base: str, adapter: str | None, prompt: tuple) -> tuple:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(NEW):
            nxt = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], 1)
    return tuple(ids[0, len(prompt):].tolist())


def _engine(model, lora, **kw):
    from inference.engine import Engine

    return Engine(model, max_batch_size=8, max_seq_length=32, block_size=4, lora=lora, **kw)


def _run(engine, prompts, adapters):
    from inference.engine import Request
    from inference.sampling import SamplingParams

    for i, (p, a) in enumerate(zip(prompts, adapters)):
        engine.add(Request(id=str(i), prompt=p, lora_name=a,
                           params=SamplingParams(max_new_tokens=NEW, ignore_eos=True)))
    out = {str(i): [] for i in range(len(prompts))}
    while engine.has_work():
        for e in engine.step():
            out[e.id] += e.token_ids
    return [out[str(i)] for i in range(len(prompts))]


def _serve_all(folders: dict, base: str = "llama", names=("a", "b", "c")) -> dict:
    """On this grid: the mixed batch, each request alone, chunked prefill, and the prefix
    cache across adapters."""
    from inference.loading import load
    from inference.lora import LoRAManager

    model = load(hf=folders[base])[0]
    lora = LoRAManager(model, max_loras=3, max_lora_rank=8)
    for n in names:
        lora.load(n, folders[n])
    adapters = [a if a is None or a in names else names[0] for a in ADAPTER_OF]
    out = {"mixed": _run(_engine(model, lora), PROMPTS, adapters)}
    out["alone"] = [_run(_engine(model, lora), [p], [a])[0] for p, a in zip(PROMPTS, adapters)]
    out["chunked"] = _run(_engine(model, lora, max_num_batched_tokens=5), PROMPTS, adapters)
    # the same prompt under the base and each adapter, one after the other, one engine
    engine = _engine(model, lora)
    shared = [PROMPTS[3]] * 4
    out["shared"] = [_run(engine, [p], [a])[0] for p, a in zip(shared, [None, *names])]
    out["shared_hits"] = engine.prefix_hits
    out["again"] = _run(engine, [PROMPTS[3]], [names[0]])[0]
    out["again_hits"] = engine.prefix_hits - out["shared_hits"]
    return out if torch.distributed.get_rank() == 0 else None


def _layouts(folders: dict) -> dict:
    import parallel_state as ps
    from inference.loading import initialize_serving_grid

    out = {}
    for tp, pp in ((2, 1), (1, 2)):
        ps.destroy_model_parallel()
        initialize_serving_grid(tp, pp)
        out[f"tp{tp}pp{pp}"] = _serve_all(folders)
    return out if torch.distributed.get_rank() == 0 else None


def test_mixed_adapter_batch_equals_alone_and_peft(folders):
    out = _in_one_process(_serve_all, folders)
    ref = [_peft_greedy(folders["llama"], a and folders[a], p)
           for p, a in zip(PROMPTS, ADAPTER_OF)]
    assert out["mixed"] == ref
    assert out["alone"] == ref
    assert out["chunked"] == ref
    # the adapters change the answers (else the test could not fail)
    assert len({tuple(x) for x in out["shared"]}) == 4, out["shared"]
    # each adapter's run of the same prompt computed its own blocks: no hit across adapters
    assert out["shared_hits"] == 0
    # the same prompt under the same adapter again: its full blocks are shared
    assert out["again"] == out["shared"][1] and out["again_hits"] == 8
    # a Qwen3 base (q/k norms) and an all-linear adapter: peft's ids too
    q = _in_one_process(lambda: _run(_engine(*_qwen3(folders)), PROMPTS[:3], ["q"] * 3))
    assert q == [_peft_greedy(folders["qwen3"], folders["q"], p) for p in PROMPTS[:3]]


def _qwen3(folders):
    from inference.loading import load
    from inference.lora import LoRAManager

    model = load(hf=folders["qwen3"])[0]
    lora = LoRAManager(model, max_loras=1, max_lora_rank=4)
    lora.load("q", folders["q"])
    return model, lora


def test_tp2_and_pp2_give_the_same_ids(folders):
    out = run_distributed(_layouts, 2, folders, timeout=300)[0]
    ref = [_peft_greedy(folders["llama"], a and folders[a], p)
           for p, a in zip(PROMPTS, ADAPTER_OF)]
    for layout in ("tp2pp1", "tp1pp2"):
        assert out[layout]["mixed"] == ref, layout
        assert out[layout]["chunked"] == ref, layout
        assert out[layout]["shared_hits"] == 0, layout


def _in_one_process(fn, *args):
    import parallel_state as ps
    from inference.loading import initialize_serving_grid

    if not torch.distributed.is_initialized():
        ps.initialize_distributed("cpu")
    initialize_serving_grid(1, 1)
    try:
        return fn(*args)
    finally:
        ps.destroy_model_parallel()


def _hostile(folders: dict, tmp) -> None:
    from safetensors.torch import load_file, save_file

    from inference.engine import Request
    from inference.loading import load
    from inference.lora import LoRAError, LoRAManager
    from inference.sampling import SamplingParams

    model = load(hf=folders["llama"])[0]
    lora = LoRAManager(model, max_loras=2, max_lora_rank=4)
    weights = "adapter_model.safetensors"
    good = load_file(os.path.join(folders["a"], weights))
    key = next(k for k in good if "q_proj.lora_A" in k)

    def variant(name, tensors=None, config=None, drop=False):
        path = str(tmp / name)
        shutil.copytree(folders["a"], path)
        if tensors is not None:
            save_file(tensors, os.path.join(path, weights))
        if config is not None:
            cfg = json.load(open(os.path.join(path, "adapter_config.json")))
            with open(os.path.join(path, "adapter_config.json"), "w") as f:
                json.dump({**cfg, **config}, f)
        if drop:
            os.remove(os.path.join(path, weights))
        return path

    truncated = variant("truncated")
    with open(os.path.join(truncated, weights), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(truncated, weights)) // 2)
    pickled = variant("pickled", drop=True)
    torch.save(good, os.path.join(pickled, "adapter_model.bin"))
    nan = dict(good)
    nan[key] = nan[key].clone()
    nan[key][0, 0] = float("nan")
    cases = {
        truncated: "not a readable safetensors file",
        variant("shape", {**good, key: good[key][:, :32].contiguous()}): "has shape",
        pickled: "only a pickle adapter_model.bin",
        folders["b"]: "rank 8 exceeds --max-lora-rank 4",
        variant("nan", nan): "NaN or infinite",
        variant("unknown", {**good, key.replace("q_proj", "foo_proj"): good[key].clone()}):
            "not a LoRA weight of a linear this model has",
        variant("ints", {**good, key: good[key].to(torch.int32)}): "dtype I32",
        variant("half", {k: v for k, v in good.items() if "q_proj.lora_B" not in k}):
            "but not lora_B",
        variant("dora", config={"use_dora": True}): "use_dora=True is not supported",
        str(tmp / "missing"): "is not a folder",
    }
    for path, why in cases.items():
        with pytest.raises(LoRAError, match=why) as e:
            lora.load("x", path)
        assert "\n" not in str(e.value)
    assert not lora.adapters and all(not m.a.any() and not any(b.any() for b in m.b)
                                     for m in lora.layers.values())
    # capacity, names, and an adapter in use
    lora.load("a", folders["a"])
    lora.load("a2", folders["a"])
    with pytest.raises(LoRAError, match="all 2 adapter slots are taken"):
        lora.load("c", folders["c"])
    with pytest.raises(LoRAError, match="is loaded already"):
        lora.load("a", folders["a"])
    engine = _engine(model, lora)
    engine.add(Request("r", PROMPTS[0], SamplingParams(max_new_tokens=2), lora_name="a"))
    with pytest.raises(LoRAError, match="in use by 1 request") as e:
        engine.unload_lora("a")
    assert e.value.status == 409
    with pytest.raises(LoRAError, match="no LoRA adapter named 'zz'"):
        engine.add(Request("q", PROMPTS[0], SamplingParams(max_new_tokens=2), lora_name="zz"))
    engine.generate([])
    engine.unload_lora("a")
    lora.load("c", folders["c"])  # the freed slot
    assert lora.adapters["c"].slot == 1 and lora.adapters["c"].load_id == 3


def test_hostile_adapter_files_refused(folders, tmp_path):
    _in_one_process(_hostile, folders, tmp_path)


def _expected_text(folders, adapter, prompt) -> str:
    """The text the server streams for peft's greedy ids (the engine's detokenizer)."""
    from inference.detokenize import IncrementalDetokenizer
    from models.tokenizer import Tokenizer

    ids = _peft_greedy(folders["llama"], adapter and folders[adapter], prompt)
    d = IncrementalDetokenizer(Tokenizer(folders["llama"]).decode, prompt)
    return "".join(d.add(t) for t in ids) + d.finish()


def test_server_picks_adapters_by_model_and_loads_at_run_time(folders):
    """infer.py --serve at tp 2 with two adapters: the official openai client picks them by
    `model` (requests in flight together), /v1/models lists them, unknown models get 404,
    and adapters load and unload at run time (capacity and bad folders refused)."""
    import signal
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    import openai

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           os.path.join(repo, "infer.py"), "--hf", folders["llama"], "--tp", "2", "--serve",
           "--port", str(port), "--served-model-name", "tiny", "--max-batch-size", "8",
           "--enable-lora", "--lora-modules", f"a={folders['a']}", f"b={folders['b']}",
           "--max-loras", "3", "--max-lora-rank", "8", "--allow-runtime-lora-updating"]
    proc = subprocess.Popen(cmd, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            **OWN_PROCESS_GROUP)
    lines = []
    try:
        read_until(proc, lines, "serving tiny on")
        assert any("LoRA: 3 adapter slots of rank <= 8" in x for x in lines), lines
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               timeout=120, max_retries=0)
        models = {m.id: m for m in client.models.list().data}
        assert set(models) == {"tiny", "a", "b"}
        assert models["a"].parent == "tiny" and models["tiny"].parent is None

        def complete(model, prompt):
            return client.completions.create(model=model, prompt=prompt, max_tokens=NEW,
                                             temperature=0, extra_body={"ignore_eos": True}
                                             ).choices[0].text

        asks = list(zip(["a", "b", "tiny", "a", "b"], PROMPTS[:5]))
        with ThreadPoolExecutor(len(asks)) as pool:
            got = list(pool.map(lambda x: complete(*x), asks))
        want = [_expected_text(folders, None if m == "tiny" else m, p) for m, p in asks]
        assert got == want
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            complete("c", PROMPTS[0])

        def post(path, body):
            r = client._client.post(f"http://127.0.0.1:{port}{path}", json=body)
            return r.status_code, r.text

        assert post("/v1/load_lora_adapter", {"lora_name": "c", "lora_path": folders["c"]})[0] \
            == 200
        assert complete("c", PROMPTS[3]) == _expected_text(folders, "c", PROMPTS[3])
        status, text = post("/v1/load_lora_adapter", {"lora_name": "d",
                                                      "lora_path": folders["a"]})
        assert status == 400 and "all 3 adapter slots are taken" in text
        assert post("/v1/unload_lora_adapter", {"lora_name": "b"})[0] == 200
        status, text = post("/v1/load_lora_adapter", {"lora_name": "d",
                                                      "lora_path": folders["a"] + "/nope"})
        assert status == 400 and "is not a folder" in text
        with pytest.raises(openai.NotFoundError):
            complete("b", PROMPTS[0])
        status, text = post("/v1/unload_lora_adapter", {"lora_name": "b"})
        assert status == 404 and json.loads(text)["error"]["message"]
        assert {m.id for m in client.models.list().data} == {"tiny", "a", "c"}
        assert complete("a", PROMPTS[0]) == want[0]  # the others are untouched
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)

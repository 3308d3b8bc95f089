"""Data pipeline: indexed dataset format, GPT sampling, blending, preprocessing, demo corpus."""
import functools
import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from data_pipeline import (BlendedDataset, GPTDataset, IndexedDataset, IndexedDatasetBuilder,
                           build_tokenizer, build_train_valid_test_datasets, train_sentencepiece)
from data_pipeline import default_corpus
from data_pipeline.default_corpus import ensure_default_corpus
from launch import run_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
         "rho sigma tau upsilon phi chi psi omega def class return import while for").split()


def make_indexed(prefix, num_docs=40, seed=0, dtype=np.uint16, vocab=1000, eod=0):
    """Random documents (lengths 1..60, each ending with eod); returns the list of docs."""
    rng = np.random.RandomState(seed)
    docs = [np.append(rng.randint(1, vocab, size=rng.randint(0, 60)), eod) for _ in range(num_docs)]
    with IndexedDatasetBuilder(str(prefix), dtype=dtype) as b:
        for d in docs:
            b.add_document(d.tolist())
        b.finalize()
    return docs


def text_corpus(n, seed=0):
    rng = np.random.RandomState(seed)
    return [" ".join(rng.choice(WORDS, size=rng.randint(5, 40))) + f"\n\tline {i}\n"
            for i in range(n)]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("sp")
    txt = d / "train.txt"
    txt.write_text("".join(text_corpus(200)) + "héllo wörld ünïcode → ✓\n")
    return train_sentencepiece([str(txt)], str(d / "tiny"), 300)


# ---------------------------------------------------------------- indexed dataset

@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_indexed_round_trip(tmp_path, dtype):
    vocab = 60000 if dtype == np.uint16 else 200000
    docs = make_indexed(tmp_path / "d", dtype=dtype, vocab=vocab)
    ds = IndexedDataset(str(tmp_path / "d"))
    assert len(ds) == len(docs) and ds.dtype == np.dtype(dtype)
    assert ds.sizes.dtype == np.int32 and ds.sizes.tolist() == [len(d) for d in docs]
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)
    np.testing.assert_array_equal(ds.get(3, 2, 4), docs[3][2:6])
    np.testing.assert_array_equal(ds[-1], docs[-1])
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]  # temp files were moved


def test_builder_rejects_ids_out_of_dtype_and_picks_dtype(tmp_path):
    with IndexedDatasetBuilder(str(tmp_path / "a"), dtype=np.uint16) as b:
        with pytest.raises(ValueError, match="int32"):
            b.add_document([70000])
    assert not os.path.exists(tmp_path / "a.bin")
    assert IndexedDatasetBuilder(str(tmp_path / "b"), vocab_size=32000).dtype == np.uint16
    assert IndexedDatasetBuilder(str(tmp_path / "c"), vocab_size=128256).dtype == np.int32


def test_corrupt_index_errors_name_file_and_fix(tmp_path):
    prefix = str(tmp_path / "d")
    make_indexed(prefix)
    idx = prefix + ".idx"
    raw = open(idx, "rb").read()
    with open(idx, "wb") as f:
        f.write(raw[:-5])
    with pytest.raises(ValueError, match=r"truncated.*preprocess_data") as e:
        IndexedDataset(prefix)
    assert idx in str(e.value)
    with open(idx, "wb") as f:
        f.write(raw[:10])
    with pytest.raises(ValueError, match="truncated"):
        IndexedDataset(prefix)
    with open(idx, "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + raw[9:])
    with pytest.raises(ValueError, match="magic"):
        IndexedDataset(prefix)
    os.remove(idx)
    with pytest.raises(FileNotFoundError, match=r"d\.idx is missing.*preprocess_data"):
        IndexedDataset(prefix)


def test_bin_size_mismatch_is_detected(tmp_path):
    prefix = str(tmp_path / "d")
    make_indexed(prefix)
    with open(prefix + ".bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(ValueError, match=r"d\.bin"):
        IndexedDataset(prefix)


# ---------------------------------------------------------------- GPT dataset

@pytest.fixture
def indexed(tmp_path):
    make_indexed(tmp_path / "d", num_docs=50)
    return IndexedDataset(str(tmp_path / "d"))


def test_gpt_samples_are_windows_of_per_epoch_shuffled_concatenation(indexed):
    docs = np.arange(10, 40)
    ds = GPTDataset(indexed, docs, num_samples=300, seq_length=16, seed=5)
    assert len(ds) == 300
    n = ds.epoch_samples
    assert n == (int(indexed.sizes[docs].sum()) - 1) // 16 and 300 > n  # several epochs
    for e in range(3):
        doc_idx, _, shuffle = ds._epoch(e)
        assert sorted(doc_idx.tolist()) == docs.tolist()  # a permutation of the split
        stream = np.concatenate([indexed[d] for d in doc_idx]).astype(np.int64)
        ids = set()
        for k in range(n):  # epoch e's samples: every window of its stream exactly once
            s = ds[e * n + k]
            assert s.dtype == np.int64 and s.shape == (17,)
            w = int(shuffle[k])
            np.testing.assert_array_equal(s, stream[w * 16:w * 16 + 17])
            ids.add(ds.sample_id(e * n + k))
        assert ids == set(range(e * n, (e + 1) * n))
        assert shuffle.tolist() != list(range(n))
    assert ds._epoch(0)[0].tolist() != ds._epoch(1)[0].tolist()  # reshuffled per epoch
    # the order does not depend on how many samples a run plans to read
    other = GPTDataset(indexed, docs, num_samples=7, seq_length=16, seed=5)
    for i in (0, 5, n - 1, n, 2 * n + 3, 299):
        np.testing.assert_array_equal(other[i], ds[i])
    with pytest.raises(IndexError):
        ds[-1]


def test_gpt_determinism_and_seed_dependence(indexed):
    a = GPTDataset(indexed, np.arange(50), 100, 8, seed=1)
    b = GPTDataset(indexed, np.arange(50), 100, 8, seed=1)
    c = GPTDataset(indexed, np.arange(50), 100, 8, seed=2)
    sa, sb, sc = (np.stack([d[i] for i in range(100)]) for d in (a, b, c))
    np.testing.assert_array_equal(sa, sb)
    assert not np.array_equal(sa, sc)


def test_splits_are_disjoint_and_cover_documents(tmp_path):
    prefix = str(tmp_path / "d")
    make_indexed(prefix, num_docs=100)
    tr, va, te = build_train_valid_test_datasets([prefix], "80,15,5", 8, 3, (50, 20, 10))
    sets = [set(d.documents.tolist()) for d in (tr, va, te)]
    assert [len(s) for s in sets] == [80, 15, 5]
    assert not (sets[0] & sets[1]) and not (sets[0] & sets[2]) and not (sets[1] & sets[2])
    assert set().union(*sets) == set(range(100))
    assert (len(tr), len(va), len(te)) == (50, 20, 10) and tr[0].shape == (9,)
    # a zero share or zero samples gives None
    tr, va, te = build_train_valid_test_datasets([prefix], "100,0,0", 8, 3, (50, 20, 10))
    assert tr is not None and va is None and te is None
    _, va, _ = build_train_valid_test_datasets([prefix], "98,2,0", 8, 3, (50, 0, 0))
    assert va is None
    # a positive share that rounds to no documents, with samples requested, is an error
    with pytest.raises(ValueError, match=r"valid split of .*d is empty .*raise its share"):
        build_train_valid_test_datasets([prefix], "969,3,1", 8, 3, (50, 5, 0))


def test_blended_fractions_match_weights(tmp_path):
    pa, pb, pc = (str(tmp_path / n) for n in "abc")
    for i, p in enumerate((pa, pb, pc)):
        make_indexed(p, num_docs=30, seed=i)
    tr, va, te = build_train_valid_test_datasets(["2", pa, "5", pb, "3", pc], "90,10,0", 8, 7,
                                                 (1000, 50, 10))
    assert isinstance(tr, BlendedDataset) and te is None
    assert [len(d) for d in tr.datasets] == [201, 503, 302]  # ceil(w * n * 1.005)
    frac = np.bincount(tr.dataset_index, minlength=3) / len(tr)
    # greedy blending keeps every count within one sample of w * n (checked below)
    np.testing.assert_allclose(frac, [0.2, 0.5, 0.3], atol=1 / len(tr))
    for n in (10, 97, 500):  # greedy: every prefix is within one sample of its target
        counts = np.bincount(tr.dataset_index[:n], minlength=3)
        assert np.all(np.abs(counts - np.array([0.2, 0.5, 0.3]) * n) <= 1)
    d, k = int(tr.dataset_index[17]), int(tr.dataset_sample_index[17])
    np.testing.assert_array_equal(tr[17], tr.datasets[d][k])
    again = BlendedDataset(tr.datasets, [2, 5, 3], 10)  # prefix-stable, extended on demand
    np.testing.assert_array_equal(again[999], tr[999])
    np.testing.assert_array_equal(again.dataset_index[:1000], tr.dataset_index[:1000])
    assert again.sample_id(999) == tr.sample_id(999)
    # past every component's planned size nothing wraps: component samples stay distinct
    ids = [tr.sample_id(i) for i in range(3000)]
    assert len(set(ids)) == 3000
    with pytest.raises(ValueError, match="data-path"):
        build_train_valid_test_datasets(["0.5", pa, "0.5"], "1,0,0", 8, 7, (10, 0, 0))


# ---------------------------------------------------------------- tokenizer + preprocess_data

@functools.cache
def _preprocess_module():
    """tools/preprocess_data.py as a module, loaded once."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("preprocess_data_cli",
                                                  os.path.join(ROOT, "tools", "preprocess_data.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_preprocess(*args):
    """tools/preprocess_data.py *args: its `cli` in this process (exit code, stdout, stderr;
    no interpreter start per call)."""
    return run_main(_preprocess_module().cli, list(args))


def run_preprocess_process(*args):
    """tools/preprocess_data.py *args as its own process (the command line itself)."""
    return subprocess.run([sys.executable, "tools/preprocess_data.py", *map(str, args)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_preprocess_folder_round_trips(tmp_path, sp_model):
    texts = text_corpus(12, seed=1)
    src = tmp_path / "src"
    for i, t in enumerate(texts):
        (src / f"sub{i % 3}").mkdir(parents=True, exist_ok=True)
        (src / f"sub{i % 3}" / f"f{i:02d}.txt").write_text(t)
    (src / "skip.md").write_text("not matched")
    out = tmp_path / "out" / "corpus"
    r = run_preprocess("--input", src, "--output-prefix", out, "--tokenizer-model", sp_model,
                       "--workers", 2)
    assert r.returncode == 0, r.stderr
    assert "12 documents" in r.stdout
    ds, tok = IndexedDataset(f"{out}_text_document"), build_tokenizer(sp_model)
    files = sorted(str(p) for p in src.rglob("*.txt"))
    assert len(ds) == 12 and ds.dtype == np.uint16
    for i, f in enumerate(files):
        assert ds[i][-1] == tok.eod
        assert tok.decode(ds[i][:-1].tolist()) == open(f).read()


def test_preprocess_jsonl_keys_and_training_vocab(tmp_path):
    rows = [{"text": t, "title": f"title {i}"} for i, t in enumerate(text_corpus(30, seed=2))]
    rows[3]["text"] = "héllo wörld → ✓ unseen ünïcode 日本"
    src = tmp_path / "c.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "c"
    r = run_preprocess("--input", src, "--json-keys", "text", "title", "--output-prefix", out,
                       "--vocab-size", 300, "--no-append-eod")
    assert r.returncode == 0, r.stderr
    tok = build_tokenizer(f"{out}.model")
    for key in ("text", "title"):
        ds = IndexedDataset(f"{out}_{key}_document")
        assert len(ds) == 30
        for i in range(30):
            assert tok.decode(ds[i].tolist()) == rows[i][key]  # no EOD, exact text back
    r = run_preprocess("--input", src, "--json-keys", "body", "--output-prefix", out,
                       "--tokenizer-model", f"{out}.model")
    assert r.returncode != 0 and "body" in r.stderr and "columns" in r.stderr


def hf_tokenizer_dir(path, texts):
    """A tiny byte-level BPE tokenizer saved as a Hugging Face folder (no hub access)."""
    from tokenizers import Tokenizer as RawTokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>").save_pretrained(path)
    return str(path)


def test_preprocess_parquet_and_saved_dataset_with_hf_tokenizer(tmp_path):
    import datasets

    texts = text_corpus(20, seed=4)
    tok_dir = hf_tokenizer_dir(tmp_path / "hf", texts)
    tok = build_tokenizer(tok_dir)
    assert tok.kind == "hf" and tok.eod == 0 and tok.decode(tok.encode(texts[0])) == texts[0]
    ds = datasets.Dataset.from_dict({"content": texts})
    ds.to_parquet(str(tmp_path / "c.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    for src in ("c.parquet", "saved"):
        out = tmp_path / f"out_{src}"
        r = run_preprocess("--input", tmp_path / src, "--json-keys", "content",
                           "--output-prefix", out, "--tokenizer-dir", tok_dir)
        assert r.returncode == 0, r.stderr
        idx = IndexedDataset(f"{out}_content_document")
        assert len(idx) == 20
        assert [tok.decode(idx[i][:-1].tolist()) for i in range(20)] == texts
        assert all(idx[i][-1] == tok.eod for i in range(20))


def test_preprocess_clear_errors(tmp_path, sp_model):
    r = run_preprocess("--input", tmp_path / "nope.jsonl", "--output-prefix", tmp_path / "x",
                       "--tokenizer-model", sp_model)
    assert r.returncode != 0 and "nope.jsonl does not exist" in r.stderr
    r = run_preprocess("--input", tmp_path, "--output-prefix", tmp_path / "x")
    assert r.returncode != 0 and "--tokenizer-model" in r.stderr
    with pytest.raises(FileNotFoundError, match="missing.model"):
        build_tokenizer(str(tmp_path / "missing.model"))


@pytest.fixture(scope="module")
def preprocess_cli():
    """tools/preprocess_data.py's `cli` in-process (no interpreter start per case)."""
    return _preprocess_module().cli


def test_preprocess_binary_input_exits_2_without_traceback(tmp_path, sp_model):
    png = tmp_path / "img.txt"
    png.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    r = run_preprocess_process("--input", png, "--output-prefix", tmp_path / "x",
                       "--tokenizer-model", sp_model)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"{png} is a binary file" in r.stderr and len(r.stderr.strip().splitlines()) == 1


BAD_INPUTS = [
    ("bad_json", r"c\.jsonl line 3 is not valid JSON.*fix or remove that line"),
    ("binary_in_folder", r"b\.txt is a binary file.*--pattern"),
    ("empty_jsonl", r"no text in .*c\.jsonl.*no documents"),
    ("blank_jsonl", r"c\.jsonl has no JSON lines.*no documents"),
    ("empty_txt", r"no text in .*c\.txt"),
    ("whitespace_txt", r"no text in .*c\.txt"),
    ("empty_folder_files", r"no text in .*src.*empty or missing"),
    ("all_null", r"no text in .*c\.jsonl"),
    ("list_value", r"c\.jsonl line 2: key 'text' is not a string but list \['a', 'b'\]"),
    ("list_value_later", r"c\.jsonl line 3: key 'text' is not a string but list"),
    ("number_value", r"c\.jsonl line 2: key 'text' is not a string but int 5"),
    ("array_line", r"c\.jsonl line 1 is a JSON list, not an object"),
]


@pytest.mark.parametrize("case, expect", BAD_INPUTS, ids=[c for c, _ in BAD_INPUTS])
def test_preprocess_bad_inputs_are_one_line_errors(tmp_path, sp_model, preprocess_cli, capsys,
                                                   case, expect):
    jl = tmp_path / "c.jsonl"
    src = jl
    if case == "bad_json":
        jl.write_text('{"text": "a"}\n\n{"text": oops}\n{"text": "b"}\n')
    elif case == "binary_in_folder":
        src = tmp_path / "src"
        src.mkdir()
        (src / "a.txt").write_text("fine text\n")
        (src / "b.txt").write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(64))
    elif case == "empty_jsonl":
        jl.write_text("")
    elif case == "blank_jsonl":
        jl.write_text("\n  \n")
    elif case in ("empty_txt", "whitespace_txt"):
        src = tmp_path / "c.txt"
        src.write_text("" if case == "empty_txt" else "\n   \n\t\n")
    elif case == "empty_folder_files":
        src = tmp_path / "src"
        src.mkdir()
        (src / "a.txt").write_text("")
        (src / "b.txt").write_text("  \n")
    elif case == "all_null":
        jl.write_text('{"text": null}\n{"other": "x"}\n{"text": ""}\n')
    elif case == "list_value":
        jl.write_text('{"text": "a"}\n{"text": ["a", "b"]}\n')
    elif case == "list_value_later":  # datasets' own schema error, diagnosed by line
        jl.write_text('{"text": "a"}\n\n{"text": ["a", "b"]}\n')
    elif case == "number_value":
        jl.write_text('{"text": "a"}\n{"text": 5}\n')
    elif case == "array_line":
        jl.write_text('[1, 2]\n')
    out = tmp_path / "out" / "x"
    assert preprocess_cli(["--input", str(src), "--output-prefix", str(out),
                           "--tokenizer-model", sp_model]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("preprocess_data")]
    assert len(lines) == 1 and lines[0].startswith("preprocess_data: error: "), err
    assert re.search(expect, lines[0]), lines[0]
    assert not os.path.exists(f"{out}_text_document.bin")


def test_preprocess_skips_empty_documents_and_counts_them(tmp_path, sp_model, preprocess_cli,
                                                          capsys):
    src = tmp_path / "c.jsonl"
    src.write_text('{"text": "alpha beta"}\n{"text": null}\n{"title": "x"}\n{"text": "  "}\n'
                   '{"text": "gamma"}\n')
    out = tmp_path / "x"
    assert preprocess_cli(["--input", str(src), "--output-prefix", str(out),
                           "--tokenizer-model", sp_model]) == 0
    cap = capsys.readouterr()
    assert "2 documents (3 empty skipped)" in cap.out
    assert "warning: skipped 3 empty or missing documents" in cap.err
    ds, tok = IndexedDataset(f"{out}_text_document"), build_tokenizer(sp_model)
    assert [tok.decode(ds[i][:-1].tolist()) for i in range(len(ds))] == ["alpha beta", "gamma"]
    # a folder: empty files are skipped the same way
    d = tmp_path / "src"
    d.mkdir()
    (d / "a.txt").write_text("delta\n")
    (d / "b.txt").write_text("")
    assert preprocess_cli(["--input", str(d), "--output-prefix", str(tmp_path / "y"),
                           "--tokenizer-model", sp_model]) == 0
    assert "1 documents (1 empty skipped)" in capsys.readouterr().out


def test_preprocess_warns_when_trained_vocab_is_smaller(tmp_path, preprocess_cli, capsys):
    src = tmp_path / "c.txt"
    src.write_text("tiny corpus\n")
    out = tmp_path / "x"
    assert preprocess_cli(["--input", str(src), "--output-prefix", str(out),
                           "--vocab-size", "100000"]) == 0
    err = capsys.readouterr().err
    vocab = build_tokenizer(f"{out}.model").vocab_size
    assert vocab < 100000
    assert f"warning: trained vocab has {vocab} ids, fewer than --vocab-size 100000" in err


# ---------------------------------------------------------------- default corpus

def small_files(tmp_path, n=15):
    d = tmp_path / "files"
    d.mkdir()
    for i, t in enumerate(text_corpus(n, seed=3)):
        (d / f"m{i:02d}.py").write_text(t * 20)
    return sorted(str(p) for p in d.iterdir())


def test_default_corpus_builds_once_under_concurrency(tmp_path):
    files = small_files(tmp_path)
    cache = tmp_path / "cache"
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {ROOT!r})
        from data_pipeline.default_corpus import ensure_default_corpus
        print("RESULT", ensure_default_corpus({str(cache)!r}, 400, files={files!r}))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sum("built the demo corpus" in o for o in outs) == 1
    assert sum("using the cached demo corpus" in o for o in outs) == 2
    # one message line each; the builder also says its steps (the tokenizer, tokenizing)
    assert all(len([ln for ln in o.strip().splitlines() if not ln.startswith("demo corpus: ")])
               == 2 for o in outs)
    results = {o.split("RESULT", 1)[1].strip() for o in outs}
    assert len(results) == 1
    prefix, model = ensure_default_corpus(str(cache), 400, files=files, quiet=True)
    ds, tok = IndexedDataset(prefix), build_tokenizer(model)
    assert len(ds) == len(files)
    assert tok.decode(ds[0][:-1].tolist()) == open(files[0]).read()
    assert not [p for p in os.listdir(cache) if ".tmp-" in p]


def test_default_corpus_killed_build_leaves_no_cache(tmp_path, monkeypatch, capsys):
    files = small_files(tmp_path)
    cache = str(tmp_path / "cache")
    real = default_corpus.build_corpus

    def crash(folder, *a):
        open(os.path.join(folder, "corpus_text_document.bin"), "w").close()
        raise KeyboardInterrupt

    monkeypatch.setattr(default_corpus, "build_corpus", crash)
    with pytest.raises(KeyboardInterrupt):
        ensure_default_corpus(cache, 400, files=files)
    assert [p for p in os.listdir(cache) if not p.endswith(".lock")] == []
    # a leftover temp folder of a process killed with SIGKILL is removed by the next build
    key = next(p for p in os.listdir(cache) if p.endswith(".lock"))[:-5]
    os.makedirs(os.path.join(cache, key + ".tmp-999999"))
    monkeypatch.setattr(default_corpus, "build_corpus", real)
    prefix, _ = ensure_default_corpus(cache, 400, files=files)
    assert "built the demo corpus" in capsys.readouterr().out
    assert sorted(os.listdir(cache)) == [key, key + ".lock"]
    assert len(IndexedDataset(prefix)) == len(files)

"""Incremental detokenization (inference/detokenize.py) over real tokenizers: a Llama-2-style
byte-fallback tokenizer (HF, Metaspace-like with a stripped leading space), the project's own
SentencePiece model (byte fallback) and byte-level BPE (GPT-2 / SmolLM2 style). The pieces of
random outputs, fed one id at a time, concatenate to the decoded output; no piece ever holds
half a character; stop strings made of multi-byte characters cut where they should."""
from __future__ import annotations

import os
import random
import string

from inference.detokenize import IncrementalDetokenizer

TEXT = "ab 😀 é 好 x, naïve café — 東京 🚀 done"


def llama2_style_tokenizer():
    """A BPE tokenizer with byte fallback and Llama-2's normalizer and decoder (built here:
    nothing can be downloaded). Characters outside its alphabet become <0xXX> byte tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in "▁" + string.ascii_letters + string.digits + string.punctuation:
        vocab.setdefault(ch, len(vocab))
    merges = [("▁", "a"), ("▁", "x"), ("a", "b"), ("▁", "d"), ("o", "n")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>",
                              byte_fallback=True, fuse_unk=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                          normalizers.Replace(" ", "▁")])
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


def _tokenizers(tmp):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from models.tokenizer import Tokenizer as Ours, train_sentencepiece

    corpus = os.path.join(os.path.dirname(os.__file__), "textwrap.py")
    hf = llama2_style_tokenizer()
    yield "llama2-style", lambda t: hf(t, add_special_tokens=False)["input_ids"], \
        lambda ids: hf.decode(ids, skip_special_tokens=True), len(hf)
    sp = Ours(train_sentencepiece([corpus], os.path.join(tmp, "sp"), 400))
    yield "sentencepiece", sp.encode, sp.decode, sp.vocab_size
    bl = Tokenizer(models.BPE(unk_token="<unk>"))
    bl.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bl.decoder = decoders.ByteLevel()
    bl.train_from_iterator([open(corpus).read()], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe = PreTrainedTokenizerFast(tokenizer_object=bl, unk_token="<unk>", eos_token="</s>")
    yield "byte-level", lambda t: bpe(t, add_special_tokens=False)["input_ids"], \
        lambda ids: bpe.decode(ids, skip_special_tokens=True), len(bpe)


def _pieces(decode, prompt, output):
    d = IncrementalDetokenizer(decode, prompt)
    pieces = [d.add(t) for t in output]
    return pieces, d.finish()


def test_pieces_concatenate_to_the_decoded_output(tmp_path):
    rng = random.Random(0)
    words = TEXT.split() + ["the", "wrap", "width", "\n", "\t", "ü", "ß", "👍🏽", "中文"]
    for name, encode, decode, vocab in _tokenizers(str(tmp_path)):
        ids = encode(TEXT)
        pieces, rest = _pieces(decode, [], ids)
        assert "".join(pieces) + rest == decode(ids) == TEXT, name
        assert rest == "" and not any("\ufffd" in p for p in pieces), (name, pieces)
        assert len(ids) > len([p for p in pieces if p]), name  # multi-token characters held
        for trial in range(60):
            prompt = encode(" ".join(rng.choice(words) for _ in range(rng.randint(1, 4))))
            out = encode(" ".join(rng.choice(words) for _ in range(rng.randint(1, 8))))
            ctx = prompt[-5:]
            whole, before = decode(ctx + out), decode(ctx)
            assert whole.startswith(before), (name, whole, before)
            pieces, rest = _pieces(decode, prompt, out)
            assert "".join(pieces) + rest == whole[len(before):], (name, prompt, out)
            assert rest == "" and not any("\ufffd" in p for p in pieces), (name, pieces)
            # an output that ends inside a character: the whole characters come out while
            # running, the cut bytes as U+FFFD at the end (a ByteFallback decode of all the
            # ids would blank the whole trailing byte run instead)
            cut = [t for t in encode("😀") if decode([t]).strip()][:-1]  # no "▁" token
            pieces, rest = _pieces(decode, prompt, out + cut)
            assert "".join(pieces) == whole[len(before):], (name, pieces)
            assert rest and set(rest) == {"\ufffd"}, (name, rest)
            # random ids (stray bytes, special ids): never an error, never a held-back tail
            noise = out + [rng.randrange(vocab) for _ in range(rng.randint(1, 8))]
            pieces, rest = _pieces(decode, prompt, noise)
            assert not any(p.endswith("\ufffd") for p in pieces), (name, pieces)
        # without a prompt the pieces are exactly decode(output)
        out = encode("x " + TEXT)
        assert "".join(_pieces(decode, [], out)[0]) == decode(out), name


def test_engine_text_and_stop_strings_with_multibyte_characters():
    """The engine's text events over a byte-fallback tokenizer: forced ids spelling multi-byte
    text, with a stop string made of a multi-byte character."""
    from inference.engine import Engine, Request
    from inference.sampling import SamplingParams

    tok = llama2_style_tokenizer()
    target = tok("ab 😀 é 好 x", add_special_tokens=False)["input_ids"]

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=True)

    engine = Engine.__new__(Engine)  # only the text path: no model needed
    engine.decode, engine.eos, engine.encoder_decoder = decode, {2}, False
    engine.waiting, engine.running, engine.busy, engine.spec = [], [], set(), None
    engine.num_left = 0
    # the prompt is the context of the first token: its leading space stays (as in vLLM)
    for stop, want, reason in (([], " ab 😀 é 好 x", "length"), (["好"], " ab 😀 é ", "stop"),
                               (["😀 é"], " ab ", "stop")):
        r = Request("r", [5], SamplingParams(max_new_tokens=len(target), stop=stop))
        engine.running.append(r)
        events = [engine._append(r, t) for t in target]
        if reason == "stop":
            events = events[:next(i for i, e in enumerate(events) if e.finish_reason) + 1]
        text = "".join(e.text for e in events)
        assert text == want and events[-1].finish_reason == reason, (stop, text, events)
        assert not any("\ufffd" in e.text for e in events), events

"""Tokenizers shared by training, inference and tools: SentencePiece models and HF folders.

`build_tokenizer(path)` accepts either a SentencePiece ``.model`` file or a folder that
``transformers.AutoTokenizer`` can load offline; both are wrapped in one `Tokenizer` with the
few things the data pipeline and the model need: ``vocab_size``, ``eod`` and encode/decode.
`train_sentencepiece` trains a byte-fallback BPE model suited to source code and prose
(identity normalisation, whitespace kept, newline and tab as their own pieces), so
``decode(encode(text)) == text`` for any UTF-8 text.
"""
from __future__ import annotations

import json
import os
import re
from functools import lru_cache
from typing import Iterable, Sequence

# Special ids fixed by `train_sentencepiece` (Llama-style order: unk, bos, eos, pad).
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3


class Tokenizer:
    """One interface over a SentencePiece model or a Hugging Face tokenizer.

    Attributes:
        vocab_size: number of token ids the model must embed (every id `encode` can return
            is in ``[0, vocab_size)``; for HF this counts added tokens too).
        eod: end-of-document id appended after every document (SentencePiece: the eos id;
            HF: ``eos_token_id``).
        path: the file or folder the tokenizer was loaded from.
        kind: ``"sentencepiece"`` or ``"hf"``.

    `encode` never adds BOS/EOS; documents get ``eod`` appended by the preprocessing step.
    """

    def __init__(self, path: str, **hf_kwargs):
        self.path = path
        if os.path.isdir(path) or hf_kwargs:
            self.kind = "hf"
            self._init_hf(path, **hf_kwargs)
        else:
            self.kind = "sentencepiece"
            self._init_sentencepiece(path)

    def _init_sentencepiece(self, path: str) -> None:
        import sentencepiece as spm

        try:
            self._sp = spm.SentencePieceProcessor(model_file=path)
        except (OSError, RuntimeError) as e:
            raise ValueError(
                f"{path} is not a readable SentencePiece model ({e}); pass a .model file written "
                "by SentencePiece (tools/preprocess_data.py --vocab-size N trains one)") from e
        self.vocab_size = int(self._sp.vocab_size())
        eos = int(self._sp.eos_id())
        if eos < 0:
            raise ValueError(f"SentencePiece model {path} defines no eos id; retrain it with "
                             "eos_id set (train_sentencepiece does this)")
        self.eod = eos
        self.bos = int(self._sp.bos_id())
        self.pad = int(self._sp.pad_id())

    def _init_hf(self, path: str, **kwargs) -> None:
        from models.hf.tokenizer_files import TokenizerFileError, load_hf_tokenizer

        try:
            self._hf = load_hf_tokenizer(path, **kwargs)  # its files checked first
        except TokenizerFileError:
            raise  # a file of it is refused: the message names it
        except (OSError, ValueError) as e:
            if "trust_remote_code" in str(e):
                raise ValueError(
                    f"the tokenizer in {path} names its own Python code (auto_map in "
                    f"tokenizer_config.json); code shipped with model files is never run: "
                    f"use a tokenizer of a class transformers has (remove auto_map)") from None
            raise ValueError(
                f"could not load a Hugging Face tokenizer from folder {path} ({e}); it must "
                "hold tokenizer.json or the files of a slow tokenizer (e.g. tokenizer.model, "
                "vocab.json + merges.txt) plus tokenizer_config.json") from e
        if self._hf.eos_token_id is None:
            raise ValueError(f"Hugging Face tokenizer in {path} has no eos_token; set "
                             "eos_token in its tokenizer_config.json")
        self.vocab_size = len(self._hf)
        self.eod = int(self._hf.eos_token_id)
        self.bos = self._hf.bos_token_id if self._hf.bos_token_id is not None else -1
        self.pad = self._hf.pad_token_id if self._hf.pad_token_id is not None else -1

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added)."""
        if self.kind == "sentencepiece":
            return self._sp.encode(text)
        return self._hf(text, add_special_tokens=False)["input_ids"]

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """Encode many texts at once; SentencePiece uses ``num_threads`` C++ threads, HF fast
        tokenizers parallelise in Rust on their own."""
        texts = list(texts)
        if not texts:
            return []
        if self.kind == "sentencepiece":
            return self._sp.encode(texts, num_threads=max(1, num_threads))
        return self._hf(texts, add_special_tokens=False)["input_ids"]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` (special tokens are dropped)."""
        ids = [int(i) for i in ids]
        if self.kind == "sentencepiece":
            return self._sp.decode(ids)
        return self._hf.decode(ids, skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes token `token_id` stands for in decoded text (cached per id), so the bytes
        of consecutive tokens concatenate to their text (OpenAI's logprobs `bytes`).

        A byte-fallback piece (``<0xE2>``) or a byte-level BPE token (GPT-2's byte alphabet) is
        its raw bytes, which may be part of a multi-byte character; a SentencePiece piece has
        its ``▁`` as a space (kept where `decode` drops a first token's leading space, as vLLM
        keeps it); a special or added token is its text (``</s>``); other HF decoders
        (WordPiece, ...) give the UTF-8 of ``decode([token_id])``. None for an id the
        tokenizer does not have (a model's padded vocabulary)."""
        cache = self.__dict__.setdefault("_bytes_of", {})
        token_id = int(token_id)
        if token_id not in cache:
            cache[token_id] = self._token_bytes(token_id) if 0 <= token_id < self.vocab_size \
                else None
        return cache[token_id]

    def _token_bytes(self, i: int) -> bytes | None:
        if self.kind == "sentencepiece":
            piece = self._sp.id_to_piece(i)
            if self._sp.is_byte(i):
                return bytes([int(piece[3:-1], 16)])
            if self._sp.is_control(i) or self._sp.is_unknown(i):
                return piece.encode()
            return piece.replace("\u2581", " ").encode()
        piece = self._hf.convert_ids_to_tokens(i)
        if piece is None:
            return None
        if i in self._hf.added_tokens_decoder:  # special / added tokens are stored as text
            return piece.encode()
        kinds, space = self._decoder_kinds()
        if "ByteLevel" in kinds:
            table = _byte_level_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return piece.encode()
        if "ByteFallback" in kinds and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
            return bytes([int(piece[3:5], 16)])
        if space is not None:
            return piece.replace(space, " ").encode()
        return self._hf.decode([i]).encode()

    def _decoder_kinds(self) -> tuple[set, str | None]:
        """(types of the HF fast tokenizer's decoders, the character its Metaspace / Replace
        decoder turns into a space or None); (set(), None) for a slow tokenizer."""
        if "_kinds" not in self.__dict__:
            backend = getattr(self._hf, "backend_tokenizer", None)
            dec = backend.decoder if backend is not None else None
            tree = json.loads(dec.__getstate__()) if dec is not None else {}
            parts = tree.get("decoders", [tree]) if tree else []
            kinds, space = {d.get("type") for d in parts}, None
            for d in parts:
                if d.get("type") == "Metaspace":
                    space = d.get("replacement", "\u2581")
                elif d.get("type") == "Replace" and d.get("content") == " ":
                    space = (d.get("pattern") or {}).get("String", space)
            self._kinds = kinds, space
        return self._kinds

    @property
    def max_token_chars(self) -> int:
        """The most characters of text one token stands for (its piece's length: a byte-level
        BPE piece has one character per byte, so this bounds the text's characters too);
        computed once. A text longer than `n * max_token_chars` has more than n tokens."""
        if "_max_token_chars" not in self.__dict__:
            if self.kind == "sentencepiece":
                pieces = (self._sp.id_to_piece(i) for i in range(self.vocab_size))
            else:
                pieces = self._hf.convert_ids_to_tokens(list(range(len(self._hf))))
            self._max_token_chars = max(1, max(len(p) for p in pieces if p))
        return self._max_token_chars

    @property
    def has_chat_template(self) -> bool:
        return self.kind == "hf" and bool(getattr(self._hf, "chat_template", None))

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            **template_kwargs) -> list[int]:
        """Token ids of chat `messages` (`[{"role": ..., "content": ...}]`) in the HF
        tokenizer's chat template, ending with the assistant's generation prompt: the
        template rendered as transformers' `apply_chat_template` renders it (its variables:
        the messages, `add_generation_prompt`, the special tokens), but bounded in time and
        size (models/chat_template.py: the template is untrusted code), then encoded
        without special tokens added. `tools` (OpenAI's function list) and `template_kwargs`
        (a request's `chat_template_kwargs`, e.g. `enable_thinking`) are the template's
        variables too.

        Raises `ValueError` when the tokenizer has no chat template (SentencePiece models and
        base models usually have none), and `chat_template.ChatTemplateError` (a
        `ValueError`, one line) when the template fails or goes past its bounds."""
        from .chat_template import render_chat_template

        if not self.has_chat_template:
            raise ValueError(f"tokenizer {self.path} has no chat template; send a plain "
                             f"completion (no --chat, /v1/completions)")
        text = render_chat_template(
            self._hf.get_chat_template(), **{
                **self._hf.special_tokens_map, "tools": tools, "documents": None,
                "add_generation_prompt": True, **template_kwargs, "messages": messages})
        return self.encode(text)

    def __repr__(self) -> str:
        return (f"Tokenizer({self.kind}, vocab_size={self.vocab_size}, eod={self.eod}, "
                f"path={self.path!r})")


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """Byte-level BPE's alphabet (Radford et al. 2019, GPT-2 `bytes_to_unicode`): character ->
    byte. Printable bytes other than space stand for themselves; the other 68 bytes are
    written as the characters from U+0100 on, in byte order."""
    own = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
           *range(ord("\u00ae"), ord("\u00ff") + 1)]
    moved = [b for b in range(256) if b not in own]
    table = {chr(b): b for b in own}
    table.update({chr(256 + n): b for n, b in enumerate(moved)})
    return table


def build_tokenizer(path: str) -> Tokenizer:
    """Load the tokenizer at ``path`` (a SentencePiece ``.model`` file, an HF folder, or a
    ``.gguf`` file's tokenizer through transformers' GGUF reader).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file/folder is not a usable tokenizer (message says what to pass).
    """
    if not path:
        raise ValueError("no tokenizer given; pass a SentencePiece .model file "
                         "(--tokenizer-model) or a Hugging Face tokenizer folder (--tokenizer-dir)")
    path = os.path.expanduser(path)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"tokenizer {path} does not exist; pass a SentencePiece .model file or a folder "
            "with Hugging Face tokenizer files (tools/preprocess_data.py --vocab-size N "
            "trains a SentencePiece model)")
    if path.endswith(".gguf") and os.path.isfile(path):
        return Tokenizer(os.path.dirname(os.path.abspath(path)),
                         gguf_file=os.path.basename(path))
    return Tokenizer(path)


def train_sentencepiece(text_files: list[str], model_prefix: str, vocab_size: int, **kw) -> str:
    """Train a byte-fallback BPE SentencePiece model on ``text_files``; return the .model path.

    Ids: unk=0, bos=1, eos=2 (the EOD), pad=3; then ``"\\n"`` and ``"\\t"`` as user-defined
    pieces and the 256 byte pieces, so every UTF-8 string encodes and decodes losslessly
    (identity normalisation, no whitespace collapsing, no dummy prefix). Training reads at
    most ``input_sentence_size`` lines (default 300k, shuffled), which keeps an 8k-vocab
    model under ~10 s on 2 cores. ``hard_vocab_limit`` is off so a tiny corpus yields a
    smaller vocab instead of failing; read the real size from `Tokenizer.vocab_size`. When
    the vocab cannot hold every character, ``character_coverage`` is lowered step by step
    (rare characters then go through byte pieces, still lossless).
    Extra ``kw`` override any SentencePieceTrainer option.

    Raises:
        FileNotFoundError: a text file is missing.
        ValueError: no text files, vocab_size too small for the byte pieces, or training
            failed (the SentencePiece message is included).
    """
    import sentencepiece as spm

    if not text_files:
        raise ValueError("train_sentencepiece needs at least one text file")
    for f in text_files:
        if not os.path.isfile(f):
            raise FileNotFoundError(f"tokenizer training file {f} does not exist")
    if vocab_size < 300:
        raise ValueError(f"vocab_size {vocab_size} is too small: byte fallback alone takes 262 "
                         "ids; use at least 300")
    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
    opts = dict(
        input=list(text_files), model_prefix=model_prefix, vocab_size=vocab_size,
        model_type="bpe", byte_fallback=True, character_coverage=0.9999,
        unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID,
        user_defined_symbols=["\n", "\t"],
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=False, allow_whitespace_only_pieces=True, split_digits=True,
        input_sentence_size=300_000, shuffle_input_sentence=True, hard_vocab_limit=False,
        num_threads=os.cpu_count() or 1, minloglevel=2,
    )
    opts.update(kw)
    # A small vocab over varied text may not fit every character; byte fallback covers the
    # rest losslessly, so lower the coverage and retry (unless the caller fixed it).
    coverages = [opts["character_coverage"]]
    if "character_coverage" not in kw:
        coverages += [0.999, 0.995, 0.98, 0.95]
    for i, cov in enumerate(coverages):
        try:
            spm.SentencePieceTrainer.train(**{**opts, "character_coverage": cov})
            break
        except RuntimeError as e:
            if "required_chars" not in str(e) or i == len(coverages) - 1:
                raise ValueError(
                    f"SentencePiece training of {model_prefix}.model failed: {e}") from e
    return model_prefix + ".model"


def encode_documents(tokenizer: Tokenizer, texts: Iterable[str], append_eod: bool = True,
                     num_threads: int = 1, batch_size: int = 256) -> Iterable[list[int]]:
    """Yield the token ids of each text in order, ``tokenizer.eod`` appended when asked.

    Texts are encoded ``batch_size`` at a time with `Tokenizer.encode_batch` so SentencePiece
    can use ``num_threads`` threads; memory stays bounded by one batch.
    """
    batch: list[str] = []

    def flush():
        for ids in tokenizer.encode_batch(batch, num_threads=num_threads):
            yield list(ids) + [tokenizer.eod] if append_eod else list(ids)
        batch.clear()

    for text in texts:
        batch.append(text)
        if len(batch) >= batch_size:
            yield from flush()
    if batch:
        yield from flush()

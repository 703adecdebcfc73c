"""The tokenizer of a depthkit run, applied as src/depthkit/data/tokenizer.cpp applies it, so that the
ids equal the C++ Tokenizer's for the same text: the SentencePiece model `depthkit data prepare`
trained (BPE with byte fallback, identity normalisation, no dummy prefix), or a Hugging Face
tokenizer.json (byte-level BPE: GPT-2, Llama-3) run by the `tokenizers` package with special-token
strings read as text and no BOS added, as the C++ one does (docs/data.md).

Text is encoded line by line: each line between newlines through SentencePiece, each newline as
the byte-fallback piece <0x0A>. SentencePiece would otherwise treat a newline as ordinary
whitespace (or split on it differently), and the model was trained on ids made this way.
"""
import os
import pathlib

import sentencepiece

NEWLINE_PIECE = "<0x0A>"  # the byte-fallback piece of b"\n"
MAX_MODEL_BYTES = 1 << 30  # as the C++ loader: a larger file is not a tokenizer model


def _is_json(path):
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    return head.startswith(b"{")


class Tokenizer:
    """encode(str) -> list[int], decode(ids) -> str, eos_id, vocab_size, path."""

    def __new__(cls, path):
        if cls is Tokenizer and pathlib.Path(path).is_file() and _is_json(path):
            return super().__new__(HfTokenizer)
        return super().__new__(cls)

    def __init__(self, path):
        self.path = pathlib.Path(path)
        # Checked before SentencePiece sees it: a directory or a FIFO would fail obscurely or block.
        if not self.path.exists():
            raise FileNotFoundError(f"{self.path}: not found (a SentencePiece tokenizer.model)")
        if not self.path.is_file():
            raise ValueError(f"{self.path}: not a regular file (a SentencePiece tokenizer.model)")
        size = self.path.stat().st_size
        if size > MAX_MODEL_BYTES:
            raise ValueError(f"{self.path}: {size} bytes, more than a tokenizer model's {MAX_MODEL_BYTES}")
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            # From the bytes, not the path: SentencePiece's own file reading reports errors on stderr.
            self._sp.LoadFromSerializedProto(self.path.read_bytes())
        except (RuntimeError, OSError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"{self.path}: cannot load SentencePiece model: {first}") from None
        self.newline_id = self._sp.piece_to_id(NEWLINE_PIECE)
        if self.newline_id == self._sp.unk_id():
            raise ValueError(f"{self.path}: tokenizer has no byte-fallback piece for '\\n' (train with byte_fallback)")
        if self._sp.eos_id() < 0:
            raise ValueError(f"{self.path}: tokenizer has no end-of-document (eos) piece")

    @property
    def eos_id(self) -> int:
        """The end-of-document id `depthkit data prepare` appends after each document."""
        return self._sp.eos_id()

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def encode(self, text: str) -> list:
        if not isinstance(text, str):
            raise TypeError(f"Tokenizer.encode takes a str, got {type(text).__name__}")
        return self._encode(text)

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        n = self.vocab_size
        for i in ids:
            if not 0 <= i < n:
                raise ValueError(f"{self.path}: cannot decode id {i}: the tokenizer has ids 0 … {n - 1}")
        return self._decode(ids)

    def _encode(self, text):
        lines = text.split("\n")
        out = []
        for i, line in enumerate(lines):
            if i > 0:
                out.append(self.newline_id)  # the newline before this line
            if line:  # an empty line (two newlines in a row, or a leading/trailing one) adds nothing
                out.extend(self._sp.encode(line, out_type=int))
        return out

    def _decode(self, ids):
        return self._sp.decode(ids)

    def __repr__(self):
        return f"Tokenizer({os.fspath(self.path)!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


class HfTokenizer(Tokenizer):
    """A tokenizer.json through the `tokenizers` package: ids as depthkit's C++ HfBpeTokenizer gives."""

    END_OF_DOCUMENT = ("<|endoftext|>", "<|end_of_text|>")  # GPT-2's, Llama-3's

    def __init__(self, path):
        self.path = pathlib.Path(path)
        size = self.path.stat().st_size
        if size > MAX_MODEL_BYTES:
            raise ValueError(f"{self.path}: {size} bytes, more than a tokenizer's {MAX_MODEL_BYTES}")
        try:
            import tokenizers
        except ImportError:
            raise ImportError(f"{self.path}: a tokenizer.json needs the `tokenizers` package "
                              f"(pip install tokenizers)") from None
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as e:  # tokenizers raises its own Exception subclass
            raise ValueError(f"{self.path}: cannot load tokenizer.json: {str(e).splitlines()[0]}") from None
        self._tok.encode_special_tokens = True  # a special token's string in text is text
        self._eos = next((i for i in map(self._tok.token_to_id, self.END_OF_DOCUMENT) if i is not None), None)
        if self._eos is None:
            raise ValueError(f"{self.path}: tokenizer has no end-of-document token ({' or '.join(self.END_OF_DOCUMENT)})")
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self._vocab_size = 1 + max(vocab.values())

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def _encode(self, text):
        return self._tok.encode(text, add_special_tokens=False).ids

    def _decode(self, ids):
        return self._tok.decode(ids)

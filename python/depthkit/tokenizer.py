"""The tokenizer of a depthkit run: the SentencePiece model `depthkit data prepare` trained (BPE with
byte fallback, identity normalisation, no dummy prefix), applied as src/depthkit/data/tokenizer.cpp
applies it, so that the ids equal the C++ Tokenizer's for the same text.

Text is encoded line by line: each line between newlines through SentencePiece, each newline as
the byte-fallback piece <0x0A>. SentencePiece would otherwise treat a newline as ordinary
whitespace (or split on it differently), and the model was trained on ids made this way.
"""
import os
import pathlib

import sentencepiece

NEWLINE_PIECE = "<0x0A>"  # the byte-fallback piece of b"\n"
MAX_MODEL_BYTES = 1 << 30  # as the C++ loader: a larger file is not a tokenizer model


class Tokenizer:
    """encode(str) -> list[int], decode(ids) -> str, eos_id, vocab_size, path."""

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
        lines = text.split("\n")
        out = []
        for i, line in enumerate(lines):
            if i > 0:
                out.append(self.newline_id)  # the newline before this line
            if line:  # an empty line (two newlines in a row, or a leading/trailing one) adds nothing
                out.extend(self._sp.encode(line, out_type=int))
        return out

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        n = self.vocab_size
        for i in ids:
            if not 0 <= i < n:
                raise ValueError(f"{self.path}: cannot decode id {i}: the tokenizer has ids 0 … {n - 1}")
        return self._sp.decode(ids)

    def __repr__(self):
        return f"Tokenizer({os.fspath(self.path)!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"

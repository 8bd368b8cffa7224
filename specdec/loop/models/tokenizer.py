"""The byte-level tokenizer of the shipped models: token = byte value, plus BOS and EOS."""
from __future__ import annotations

BOS, EOS = 256, 257
VOCAB_SIZE = 260  # 256 bytes, BOS, EOS, two reserved ids


class ByteTokenizer:
    bos_token_id = BOS
    eos_token_id = EOS
    vocab_size = VOCAB_SIZE

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return ([BOS] if bos else []) + list(text.encode("utf-8"))

    def decode(self, tokens) -> str:
        return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")


def load_tokenizer(path: str, vocab_size: int):
    """The tokenizer of a checkpoint folder: its own (tokenizer.json etc., needs transformers) if it has one,
    else the byte tokenizer when the vocabulary is ours."""
    import glob
    import os
    if glob.glob(os.path.join(path, "tokenizer*.json")):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ValueError(f"{path}: this checkpoint has its own tokenizer; `pip install transformers` to use it")
        return AutoTokenizer.from_pretrained(path)
    if vocab_size == VOCAB_SIZE:
        return ByteTokenizer()
    raise ValueError(f"{path}: no tokenizer files and a vocabulary of {vocab_size} (the byte tokenizer has "
                     f"{VOCAB_SIZE})")

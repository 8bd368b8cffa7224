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

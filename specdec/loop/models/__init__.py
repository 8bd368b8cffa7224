"""Model runner: a Llama-architecture decoder on specdec's ops, Hugging Face checkpoint I/O, byte tokenizer."""
from .hf import CheckpointError, load_model, save_model
from .llama import KVCache, Llama, LlamaConfig
from .tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer", "CheckpointError", "KVCache", "Llama", "LlamaConfig", "load_model", "save_model"]

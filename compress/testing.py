"""Tiny run folders for the hostile-input tests, the verification benchmark and their tests: a
random Llama (or any transformers config) with a byte-level BPE trained here, saved as a run
folder with a manifest; and the damage a run folder can suffer (bytes of a tensor overwritten)."""

import json
import struct
from pathlib import Path

import torch

import compress
from compress.io.manifest import write_manifest
from compress.io.source import Source

# prompts of the greedy-equivalence checks (tests/test_decoder.py, eval/bench/fast_vs_faithful.py)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "Water boils at",
]
TEXT = "the quick brown fox jumps over the lazy dog. a stitch in time saves nine."


def tiny_tokenizer(vocab: int = 300):
    """A byte-level BPE of ``vocab`` tokens (no download); id 1 is <eos>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<pad>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator([TEXT] * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<pad>")


# the tiny models' sizes: hidden 64, 4 query heads of 16 over 2 KV heads, MLP 128
SIZES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
TOKENS = dict(pad_token_id=0, bos_token_id=None)  # the tiny tokenizer's pad, and no BOS


def tiny_config(**overrides):
    """A 2-layer Llama of :data:`SIZES` over 300 tokens, tied head, eos 1."""
    from transformers import LlamaConfig

    kw = dict(SIZES, head_dim=16, vocab_size=300, num_hidden_layers=2, **TOKENS, eos_token_id=1)
    kw.update(max_position_embeddings=128, rope_theta=1e5, tie_word_embeddings=True)
    kw.update(overrides)
    return LlamaConfig(**kw)


def random_model(config, seed: int = 0, std: float = 0.05):
    """An HF causal LM of ``config`` with N(0, std) weights and unit norms."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0, std)
    return model.eval()


def run_folder(folder, model, tokenizer=None, rtn: dict | None = None) -> Path:
    """``model`` (quantized with ``compress.RTNConfig(**rtn)`` first when given) saved by
    ``compress.save``, with the manifest a recipe run writes."""

    if rtn is not None:
        compress.quantize(model, compress.RTNConfig(**rtn))
    folder = compress.save(model, folder, tokenizer=tokenizer)
    write_manifest(folder, {"name": "tiny"}, Source("tiny", "random", ""), {}, False)
    return folder


def tensor_span(path, name: str) -> tuple[int, int]:
    """Absolute ``(begin, end)`` byte offsets of tensor ``name`` in a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    b, e = header[name]["data_offsets"]
    return 8 + n + b, 8 + n + e


def overwrite(path, name: str, data: bytes = b"\x37" * 8, at: int = 4) -> None:
    """Overwrite bytes of tensor ``name`` in place (finite values: the NaN check passes)."""
    begin, end = tensor_span(path, name)
    assert begin + at + len(data) <= end
    with open(path, "r+b") as f:
        f.seek(begin + at)
        f.write(data)

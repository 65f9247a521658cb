"""The built-in decoder against transformers, on a tiny random Llama (fast) and the default model (slow)."""

import json
import os
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from compress.decoder.__main__ import main as cli
from compress.decoder.generate import generate
from compress.decoder.kv import new_cache, static_cache
from compress.decoder.model import load
from compress.decoder.sampling import Sampling, logits_to_probs
from compress.errors import CompressError
from compress.testing import tiny_config


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def tiny_tokenizer():
    """A byte-level BPE of 300 tokens trained here (no download); id 1 is <eos>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<pad>")


def tiny_hf(**overrides):
    from transformers import LlamaForCausalLM

    config = tiny_config(**{"initializer_range": 0.2, "eos_token_id": None, **overrides})
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def save(model, folder: Path, tokenizer=None, quantization_config=None) -> Path:
    from compress.io.checkpoint import save_checkpoint

    save_checkpoint(model, tokenizer, folder, quantization_config)
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(folder, HF model, tokenizer) of a tiny random Llama with tied embeddings."""
    hf, tok = tiny_hf(), tiny_tokenizer()
    return save(hf, tmp_path_factory.mktemp("tiny"), tok), hf, tok


@pytest.fixture(scope="module")
def ours(tiny):
    return load(tiny[0])


def forward(model, ids, kv="full", start=None):
    cache = new_cache(model, kv, ids.shape[0], ids.shape[1])
    with torch.no_grad():
        return model(ids, cache, start=start)


VARIANTS = {
    "llama": {},
    "llama3-rope+bias": dict(
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "linear-rope": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_transformers(variant, tmp_path):
    hf = tiny_hf(**VARIANTS[variant])
    model, _ = load(save(hf, tmp_path))
    ids = torch.randint(0, 300, (2, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    assert rel_err(forward(model, ids), ref) < 1e-5
    assert rel_err(forward(model, ids, kv="fp16"), ref) < 1e-2  # K, V rounded to fp16


def test_qwen2_biases_match_transformers(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            initializer_range=0.2,
        )
    ).eval()
    with torch.no_grad():
        for layer in hf.model.layers:  # HF initialises biases to zero; make them matter
            layer.self_attn.q_proj.bias.normal_()
            layer.self_attn.k_proj.bias.normal_()
    model, _ = load(save(hf, tmp_path))
    ids = torch.randint(0, 300, (1, 50), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel_err(forward(model, ids), hf(ids).logits) < 1e-5


def test_mistral_matches_transformers_past_its_sliding_window(tmp_path):
    """A 40-token prompt over a 16-token window (tests/test_sliding_window.py has the rest)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    hf = MistralForCausalLM(
        MistralConfig(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=16,
            initializer_range=0.2,
        )
    ).eval()
    model, _ = load(save(hf, tmp_path))
    ids = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel_err(forward(model, ids), hf(ids).logits) < 1e-5
    assert len(generate(model, [ids[0].tolist()], 10, ignore_eos=True).tokens[0]) == 10


def test_prefill_then_decode_matches_one_pass(ours):
    """Logits of tokens fed one at a time after a prefill equal those of one full forward."""
    model, _ = ours
    ids = torch.randint(0, 300, (1, 30), generator=torch.Generator().manual_seed(3))
    cache = new_cache(model, "full", 1, 30)
    with torch.no_grad():
        steps = [model(ids[:, :20], cache)] + [
            model(ids[:, t : t + 1], cache) for t in range(20, 30)
        ]
    assert cache.length == 30
    assert rel_err(torch.cat(steps, 1), forward(model, ids)) < 1e-5


def test_greedy_matches_transformers_generate(tiny, ours):
    _, hf, _ = tiny
    model, _ = ours
    prompt = [5, 17, 42, 99, 7]
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=None
        )
    r = generate(model, [prompt], 40, kv="full")
    assert r.tokens[0] == ref[0, len(prompt) :].tolist()
    assert r.decode_steps == 39 and r.kv_tokens == len(prompt) + 39


def test_batch_of_different_lengths_equals_each_alone(ours):
    model, _ = ours
    prompts = [[3, 4, 5, 6, 7, 8, 9, 10, 11], [12], [13, 14, 15, 16]]
    alone = [generate(model, [p], 25, kv="full").tokens[0] for p in prompts]
    assert generate(model, prompts, 25, kv="full").tokens == alone
    # and the left-padded prefill gives each row its own last-position logits
    from compress.decoder.generate import left_pad

    ids, start = left_pad(prompts, 0, "cpu")
    cache = new_cache(model, "full", 3, ids.shape[1])
    with torch.no_grad():
        batch = model(ids, cache, start=start, last=True)[:, -1]
    for b, p in enumerate(prompts):
        assert rel_err(batch[b], forward(model, torch.tensor([p]))[0, -1]) < 1e-5


@pytest.mark.parametrize("kv, opts", [("packkv", {"k_rel": 0.05, "v_rel": 0.05, "residual": 8})])
def test_compressed_cache_batch_equals_each_alone(kv, opts, tmp_path):
    """Left padding and compression together: a batch row decodes as its prompt does alone (the
    newest ``residual`` positions are the same tokens either way), the history really compressed.
    Not KIVI: its K groups sit at fixed positions, so padding shifts which tokens share a group."""
    model, _ = load(
        save(tiny_hf(head_dim=32, num_attention_heads=2, num_key_value_heads=1), tmp_path)
    )
    prompts = [
        [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
        [21],
        [22, 23, 24, 25, 26],
    ]
    batch = generate(model, prompts, 90, kv=kv, kv_opts=opts, ignore_eos=True)
    for b, p in enumerate(prompts):
        alone = generate(model, [p], 90, kv=kv, kv_opts=opts, ignore_eos=True)
        assert batch.tokens[b] == alone.tokens[0]
        assert (
            alone.kv_bytes_per_token < 0.5 * 2 * 2 * 2 * 32
        )  # fp16 K and V, 2 layers x 1 head x 32 dims


def test_sampling_reproducible_with_seed(ours):
    model, _ = ours
    s = Sampling(temperature=1.5, top_k=50, top_p=0.95, seed=123)
    a = generate(model, [[5, 6, 7]], 30, sampling=s).tokens
    assert generate(model, [[5, 6, 7]], 30, sampling=s).tokens == a
    s.seed = 124
    assert generate(model, [[5, 6, 7]], 30, sampling=s).tokens != a
    greedy = generate(model, [[5, 6, 7]], 30).tokens
    assert (
        generate(model, [[5, 6, 7]], 30, sampling=Sampling(temperature=1.0, top_k=1, seed=0)).tokens
        == greedy
    )


def test_top_k_top_p_probabilities():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    p = logits_to_probs(logits, Sampling(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    p = logits_to_probs(logits, Sampling(temperature=1.0, top_k=3))
    torch.testing.assert_close(p, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)
    p = logits_to_probs(logits, Sampling(temperature=0.5))  # p^(1/T), renormalised
    torch.testing.assert_close(p, torch.tensor([[0.25, 0.09, 0.0225, 0.0025]]) / 0.365)


def test_stops_on_eos_and_stop_string(tiny):
    folder, _, tok = tiny
    model, _ = load(folder)
    prompt = tok("the quick brown").input_ids
    full = generate(model, [prompt], 30, tok, kv="full")
    k = len(full.tokens[0]) // 2
    model.spec = replace(model.spec, eos_ids=(full.tokens[0][k],))  # the runtime's stops
    first = full.tokens[0].index(full.tokens[0][k])
    assert generate(model, [prompt], 30, kv="full").tokens[0] == full.tokens[0][:first]

    model.spec = replace(model.spec, eos_ids=())
    stop = full.texts[0][len(full.texts[0]) // 2 :][:3]
    pieces = []
    r = generate(
        model, [prompt], 30, tok, kv="full", stop=(stop,), on_text=lambda b, t: pieces.append(t)
    )
    cut = full.texts[0].index(stop)
    assert r.texts[0] == full.texts[0][:cut] == "".join(pieces)
    assert len(r.tokens[0]) < 30


def test_streamed_text_is_the_decoded_continuation(tiny, ours):
    _, _, tok = tiny
    model, _ = ours
    pieces = []
    r = generate(model, [tok("the lazy").input_ids], 20, tok, on_text=lambda b, t: pieces.append(t))
    assert "".join(pieces) == r.texts[0] == tok.decode(r.tokens[0], skip_special_tokens=True)


def test_folder_without_config(tmp_path):
    with pytest.raises(CompressError, match="config.json"):
        load(tmp_path)


def test_tensor_not_matching_config(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = save(tiny_hf(), tmp_path)
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors[name] = tensors[name][:16]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(
        CompressError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*\(32, 64\)"
    ):
        load(folder)


def test_empty_and_too_long_prompts(ours):
    model, _ = ours
    with pytest.raises(CompressError, match="empty"):
        generate(model, [[]], 5)
    with pytest.raises(CompressError, match="empty"):
        generate(model, [[1, 2], []], 5)
    with pytest.raises(
        CompressError, match="prompt has 130 tokens"
    ):  # max_position_embeddings is 128
        generate(model, [[5] * 130], 5)
    with pytest.raises(CompressError, match="prompt has 20 tokens"):
        generate(model, [[5] * 20], 5, max_len=20)
    with pytest.warns(UserWarning, match="stops after 4 tokens"):
        r = generate(model, [[5] * 20], 10, max_len=24)
    assert len(r.tokens[0]) == 4


@pytest.mark.parametrize("kind", ["int4", "int3", "int8", "int4-skip-k"])
def test_quantized_run_folder_matches_load_run(kind, tmp_path):
    """Decoder logits vs the pipeline's own loader (transformers + QuantLinear / Int8Linear)."""
    from compress.decoder.model import Cast, Parallel
    from compress.io.checkpoint import load_run
    from compress.methods.quant import llm_int8
    from compress.methods.quant.rtn import pack_model, quantization_config

    hf = tiny_hf()
    if kind == "int8":
        model = llm_int8.quantize_model(hf, 6.0)
        qcfg = llm_int8.quantization_config(6.0)
    elif kind == "int4-skip-k":  # k_proj stays nn.Linear: q/k/v cannot fuse into one layer
        qcfg = dict(quantization_config(4, 32), modules_to_not_convert=["k_proj"])
        k = [layer.self_attn.k_proj for layer in hf.model.layers]
        model = pack_model(hf, 4, 32)
        for layer, lin in zip(model.model.layers, k):
            layer.self_attn.k_proj = lin
    else:
        bits = 3 if kind == "int3" else 4
        model, qcfg = pack_model(hf, bits, 32), quantization_config(bits, 32)
    folder = save(model, tmp_path, quantization_config=qcfg)
    ours, _ = load(folder)
    ref, _ = load_run(folder)
    qkv = ours.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Parallel) == (kind == "int4-skip-k")
    assert type(ours.model.layers[0].mlp.gate_up_proj) is type(ref.model.layers[0].mlp.up_proj)
    ids = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert rel_err(forward(ours, ids), ref(ids).logits) < 1e-3
        if kind == "int4":  # the int4 layers computing in bfloat16: close, not exact
            fast, _ = load(folder, qdtype=torch.bfloat16)
            assert isinstance(fast.model.layers[0].mlp.gate_up_proj, Cast)
            assert 1e-5 < rel_err(forward(fast, ids), ref(ids).logits) < 5e-2


def test_cli_json_and_errors(tiny, capsys):
    folder, _, tok = tiny
    cli([str(folder), "--prompt", "the quick", "--max-new-tokens", "12", "--kv", "full", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {
        "text",
        "ttft_s",
        "decode_tok_s",
        "prefill_tok_s",
        "peak_mem_bytes",
        "kv_bytes_per_token",
        "runtime",
    }
    assert out["runtime"]["dtype"] == "float32" and not out["runtime"]["fast"]  # an fp folder
    model, _ = load(folder)
    ref = generate(model, [tok("the quick").input_ids], 12, tok, kv="full")
    assert out["text"] == ref.texts[0]
    # full cache, fp32: 2 layers x (K + V) x 2 kv heads x 16 dims x 4 bytes per token
    assert out["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    with pytest.raises(SystemExit) as e:
        cli([str(folder.parent / "nowhere"), "--prompt", "x"])
    assert e.value.code == 2 and "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli([str(folder), "--prompt", ""])
    assert e.value.code == 2 and "empty" in capsys.readouterr().err


def test_compiled_step_matches_eager(ours):
    """The static-shape compiled step (one graph for every token) against the eager model, fp32:
    a batch of two prompts of different lengths, logits of each step and greedy tokens."""
    model, _ = ours
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    eager = generate(model, prompts, 16, kv="full")
    compiled = generate(model, prompts, 16, kv="full", compile=True)
    assert (
        compiled.tokens == eager.tokens and compiled.kv_bytes_per_token == eager.kv_bytes_per_token
    )
    step = model.static_steps[2]
    assert step.compiled_calls >= 15  # the compiled graph ran (not the eager fallback)
    start = torch.tensor([0, 4])
    a, b = static_cache(new_cache(model, "full", 2, 64)), new_cache(model, "full", 2, 64)
    padded = torch.tensor([prompts[0], [0] * 4 + prompts[1]])
    with torch.no_grad():
        model(padded, a, start=start), model(padded, b, start=start)
        for t in range(5):
            x = torch.randint(0, 300, (2, 1), generator=torch.Generator().manual_seed(t))
            assert rel_err(step(x, a, start), model(x, b, start=start)) < 1e-5
    assert a.length == b.length == 12


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_step_quantized(dtype, tmp_path):
    """int4 layers in the compiled step: the K-packed GEMV (fp32) and ATen's int4pack (bf16) forms."""
    from compress.kernels.cpu import Int4PackLinear, KPlanesLinear
    from compress.layers import QuantLinear
    from compress.methods.quant.rtn import pack_model, quantization_config

    folder = save(
        pack_model(tiny_hf(), 4, 32), tmp_path, quantization_config=quantization_config(4, 32)
    )
    model, _ = load(folder, dtype=getattr(torch, dtype))
    prompt = [[5, 6, 7, 8, 9]]
    compiled = generate(model, prompt, 12, compile=True)
    step = model.static_steps[1]
    assert isinstance(
        step.model.model.layers[0].mlp.down_proj,
        KPlanesLinear if dtype == "float32" else Int4PackLinear,
    )
    assert isinstance(
        model.model.layers[0].mlp.down_proj, QuantLinear
    )  # the model keeps its own layers
    a, b = static_cache(new_cache(model, "fp16", 1, 64)), new_cache(model, "fp16", 1, 64)
    with torch.no_grad():
        model(torch.tensor(prompt), a), model(torch.tensor(prompt), b)
        for t in range(4):
            x = torch.randint(0, 300, (1, 1), generator=torch.Generator().manual_seed(t))
            assert rel_err(step(x, a), model(x, b)) < (1e-4 if dtype == "float32" else 3e-2)
    if dtype == "float32":
        assert compiled.tokens == generate(model, prompt, 12).tokens


def test_lean_load_keeps_one_form(tmp_path):
    """``lean``: the packed codes are freed, the int4pack form computes what it computed before."""
    from compress.layers import QuantLinear
    from compress.methods.quant.rtn import pack_model, quantization_config

    folder = save(
        pack_model(tiny_hf(), 4, 32), tmp_path, quantization_config=quantization_config(4, 32)
    )
    full, _ = load(folder, dtype=torch.bfloat16)
    lean, _ = load(folder, dtype=torch.bfloat16, lean=True)
    layers = [m for m in lean.modules() if isinstance(m, QuantLinear)]
    assert layers and all(m.qweight.numel() == 0 and m.cache["lean"] for m in layers)
    ids = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(
            forward(lean, ids, "fp16"), forward(full, ids, "fp16")
        )  # M <= 32: int4pack in both
        long = torch.randint(0, 300, (1, 100), generator=torch.Generator().manual_seed(6))
        exact = forward(
            load(folder)[0], long, "full"
        ).double()  # fp32: the bfloat16 runs' reference
        err = [
            (forward(m, long, "fp16").double() - exact).norm() / exact.norm() for m in (lean, full)
        ]
        assert (
            err[0] < 1.5 * err[1] + 1e-3
        )  # int4pack at M = 100 is as exact as dequantize + matmul
        with pytest.raises(CompressError, match="bfloat16 inputs"):
            layers[0](torch.randn(2, layers[0].in_features))
    with pytest.raises(CompressError, match="bfloat16"):
        load(folder, lean=True)


def test_compiled_step_errors_and_fallback(ours, monkeypatch):
    """For users a compile failure is a warning and the same step uncompiled (the suite's
    ``COMPRESS_STRICT_COMPILE=1`` unset here)."""
    from compress.decoder.compiled import StaticDecoder

    model, _ = ours
    with pytest.raises(CompressError, match="--kv fp16 or full"):
        generate(model, [[5, 6]], 4, kv="packkv", compile=True)

    def broken(*a, **k):
        raise RuntimeError("no compiler here")

    monkeypatch.delenv("COMPRESS_STRICT_COMPILE")
    monkeypatch.setattr(torch, "compile", broken)
    with pytest.warns(UserWarning, match="no compiler here"):
        step = StaticDecoder(model, 1)
    cache = static_cache(new_cache(model, "full", 1, 32))
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7]]), cache)
        with pytest.raises(CompressError, match="one token per row"):
            step(torch.tensor([[5, 6]]), cache)
        ref = new_cache(model, "full", 1, 32)
        model(torch.tensor([[5, 6, 7]]), ref)
        assert rel_err(step(torch.tensor([[8]]), cache), model(torch.tensor([[8]]), ref)) < 1e-5
    assert step.compiled_calls == 0


@pytest.mark.parametrize("when", ["compile", "call"])
def test_compile_failure_is_an_error_in_strict_mode(ours, monkeypatch, when):
    """``COMPRESS_STRICT_COMPILE=1`` (set for the whole suite): a compile failure, when
    ``torch.compile`` is called or when the compiled step first runs, raises instead of falling
    back, so a test of the compiled path cannot pass on the eager one."""
    from compress.decoder.compiled import StaticDecoder

    model, _ = ours
    assert os.environ["COMPRESS_STRICT_COMPILE"] == "1"

    def fails(*a, **k):
        raise RuntimeError("inductor bug")

    monkeypatch.setattr(torch, "compile", fails if when == "compile" else lambda fn, **k: fails)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no fallback warning either
        with pytest.raises(RuntimeError, match="COMPRESS_STRICT_COMPILE=1") as e:
            step = StaticDecoder(model, 1)
            cache = static_cache(new_cache(model, "full", 1, 32))
            with torch.no_grad():
                model(torch.tensor([[5, 6, 7]]), cache)
                step(torch.tensor([[8]]), cache)
    assert "inductor bug" in str(e.value) and isinstance(e.value.__cause__, RuntimeError)


# --- the default model (minutes) ---------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]
from compress.testing import PROMPTS  # noqa: E402  (the equivalence prompts)


@pytest.fixture(scope="module")
def default_model():
    """(folder, our model, transformers' model, tokenizer) of the fp32 default model."""
    from transformers import AutoModelForCausalLM

    from compress.io.source import convert_default_model

    folder = convert_default_model()
    model, tok = load(folder)
    return (
        folder,
        model,
        AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(),
        tok,
    )


def text_ids(tok, n: int) -> torch.Tensor:
    """The first ``n`` tokens of WikiText-2 test (or of the prompts, repeated, without the data)."""
    import os

    f = (
        Path(os.environ.get("COMPRESS_DATA_DIR", REPO.parent / "shared" / "data"))
        / "wikitext-2"
        / "wiki.test.raw"
    )
    text = f.read_text()[:20000] if f.is_file() else " ".join(PROMPTS) * 50
    return tok(text, return_tensors="pt").input_ids[:, :n]


@pytest.mark.slow
def test_default_model_logits_match_transformers(default_model):
    _, model, hf, tok = default_model
    ids = text_ids(tok, 256)
    assert ids.shape[1] == 256
    with torch.no_grad():
        assert rel_err(forward(model, ids), hf(ids).logits) < 1e-4


@pytest.mark.slow
def test_default_model_greedy_matches_transformers(default_model):
    _, model, hf, tok = default_model
    for prompt in PROMPTS:
        ids = tok(prompt).input_ids
        with torch.no_grad():  # eos_token_id=[]: no early stop, 64 tokens each
            ref = hf.generate(
                torch.tensor([ids]),
                max_new_tokens=64,
                do_sample=False,
                eos_token_id=[],
                pad_token_id=0,
            )[0, len(ids) :].tolist()
        assert len(ref) == 64
        assert generate(model, [ids], 64, kv="full", ignore_eos=True).tokens[0] == ref, prompt
        assert (
            generate(model, [ids], 64, kv="full", ignore_eos=True, compile=True).tokens[0] == ref
        ), prompt


def int4_folders():
    """The int4 run folders to check: an RTN one built by the test, and outputs/awq_int4 if it exists."""
    return [
        "rtn_int4",
        pytest.param(
            REPO / "outputs" / "awq_int4",
            marks=pytest.mark.skipif(
                not (REPO / "outputs" / "awq_int4" / "config.json").exists(),
                reason="no outputs/awq_int4; run `python -m compress recipe=awq_int4 hydra.run.dir=outputs/awq_int4`",
            ),
        ),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("folder", int4_folders())
def test_default_model_int4_matches_load_run(folder, default_model, tmp_path):
    from compress.io.checkpoint import load_run
    from compress.methods.quant.rtn import pack_model, quantization_config

    src, _, _, tok = default_model
    if folder == "rtn_int4":
        hf, _ = load_run(src)
        folder = save(pack_model(hf, 4, 64), tmp_path, tok, quantization_config(4, 64))
    model, _ = load(folder)
    ref, _ = load_run(folder)
    ids = text_ids(tok, 256)
    with torch.no_grad():
        assert rel_err(forward(model, ids), ref(ids).logits) < 1e-3

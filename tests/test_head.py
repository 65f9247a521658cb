"""The quantized output head (``compress.layers.head``): its codes against the group-wise formula,
its logits against a float64 dequantize-then-matmul, the tied embedding kept exact, the
pipeline's evaluation of the saved folder, and the decoder's fast default."""

import json

import pytest
import torch
from torch import nn

from compress.errors import CompressError
from compress.formats import compressed_tensors as ct
from compress.layers import QuantLinear
from compress.layers.head import quantize_head, recorded_head
from tests.conftest import compose

BITS = {"int8": 8, "int4": 4}


def reference_codes(w: torch.Tensor, bits: int, g: int):
    """float64 codes of the group-wise asymmetric formula: ``(q [out, in], z, s [out, in/g],
    w/s [out, in/g, g])``, the scale rounded to fp16 as stored."""
    out, k = w.shape
    wg, qmax = w.double().reshape(out, k // g, g), 2**bits - 1
    lo, hi = wg.amin(-1), wg.amax(-1)
    s = ((hi - lo).clamp(min=1e-5) / qmax).half().double()
    z = (-torch.round(lo / s)).clamp(0, qmax)
    ratio = wg / s[..., None]
    q = (torch.round(ratio) + z[..., None]).clamp(0, qmax)
    return q.reshape(out, k), z, s, ratio


def dequantized(w: torch.Tensor, bits: int, g: int) -> torch.Tensor:
    """float64 ``W_hat [out, in] = (q - z) * s`` of :func:`reference_codes`."""
    q, z, s, _ = reference_codes(w, bits, g)
    out, k = w.shape
    return ((q.reshape(out, k // g, g) - z[..., None]) * s[..., None]).reshape(out, k)


class Stub(nn.Module):
    """Anything with an ``lm_head``."""

    def __init__(self, out_features=256, in_features=128, seed=0):
        super().__init__()
        self.lm_head = nn.Linear(in_features, out_features, bias=False)
        with torch.no_grad():
            self.lm_head.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(seed))


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_codes_follow_the_groupwise_asymmetric_formula(kind):
    stub = Stub()
    w = stub.lm_head.weight.detach().clone()
    head = quantize_head(stub, kind, ct.quantization_config(4, 64))
    assert stub.lm_head is head and isinstance(head, QuantLinear)
    assert (head.bits, head.group_size) == (BITS[kind], 64)
    q_ref, z_ref, s_ref, ratio = reference_codes(w, BITS[kind], 64)
    q, z = head.codes()  # [in, out], [in/g, out]
    assert torch.equal(head.scales.t().double(), s_ref)
    assert torch.equal(z.t().double(), z_ref)
    differ = q.t().double() != q_ref
    # float32 and float64 may round a quotient within an ulp of .5 differently, nothing else
    near_tie = ((ratio - ratio.floor() - 0.5).abs() < 1e-4).reshape(q_ref.shape)
    assert not (differ & ~near_tie).any()
    assert differ.sum() <= 2 and q.min() >= 0 and q.max() == 2 ** BITS[kind] - 1


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_logits_equal_float64_dequantize_then_matmul(kind, dtype):
    """fp32: the K-packed planes; bf16: ATen's int4pack (one call for int4, two for int8)."""
    stub = Stub(seed=1)
    w = stub.lm_head.weight.detach().clone()
    head = quantize_head(stub, kind, ct.quantization_config(4, 32))
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2)).to(dtype)
    y = torch.full((5, 256), float("nan"))
    y.copy_(head(x))
    ref = x.double() @ dequantized(w, BITS[kind], 32).t()
    assert torch.isfinite(y).all()
    assert rel_err(y, ref) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert rel_err(x.double() @ w.double().t(), ref) > 1e-4  # the codes are not the float weight


def test_decoder_head_is_untied_and_the_embedding_stays_exact(tmp_path):
    from compress.decoder.model import load
    from tests.test_decoder import save, tiny_hf

    folder = save(tiny_hf(vocab_size=320), tmp_path / "tiny")
    plain, _ = load(folder)
    model, _ = load(folder, head="int8")
    assert isinstance(model.lm_head, QuantLinear) and isinstance(plain.lm_head, nn.Linear)
    assert torch.equal(model.model.embed_tokens.weight, plain.model.embed_tokens.weight)
    seen = {}
    model.lm_head.register_forward_hook(lambda m, i, o: seen.update(x=i[0], y=o))
    ids = torch.randint(0, 320, (1, 12), generator=torch.Generator().manual_seed(3))
    from compress.decoder.kv import new_cache

    with torch.no_grad():
        model(ids, new_cache(model, "full", 1, 16))
    w = plain.lm_head.weight.detach()
    ref = seen["x"].double() @ dequantized(w, 8, 64).t()
    assert rel_err(seen["y"], ref) < 1e-5
    assert model.config.tie_word_embeddings is False
    with pytest.raises(CompressError, match="none, int8, int4"):
        load(folder, head="int3")
    with pytest.raises(CompressError, match="not a multiple of 32"):
        load(save(tiny_hf(), tmp_path / "odd"), head="int4")  # 300 rows


def test_pipeline_evaluates_the_quantized_head(tiny_dir, tmp_path, monkeypatch):
    """The report's ppl is that of the saved folder with its head replaced by the float64
    dequantized codes; the manifest records the setting, the stored head is unchanged."""
    from safetensors.torch import load_file

    from compress.eval.perplexity import evaluate
    from compress.io.checkpoint import load_run
    from compress.io.data import eval_windows, read_text
    from compress.recipe.config import validate
    from compress.recipe.pipeline import run
    from tests.conftest import TINY_OVERRIDES

    monkeypatch.setenv("COMPRESS_KERNELS", "eager")  # no compile of the head's kernels here
    overrides = [f"model.path={tiny_dir}", *TINY_OVERRIDES, "quant.lm_head=int4"]
    cfg = compose("rtn_int4", overrides)
    out = tmp_path / "run"
    report = run(cfg, out)
    assert report["lm_head"] == "int4" and recorded_head(out) == "int4"
    assert report["decode_config"]["head"] == "int4" and report["decode_tok_s"] > 0
    stored = load_file(str(out / "model.safetensors"))
    assert "lm_head.weight" not in stored  # still tied on disk: loaders see the source's head
    model, tok = load_run(out)
    w = model.model.embed_tokens.weight.detach().clone()
    model.lm_head = nn.Linear(w.shape[1], w.shape[0], bias=False)
    model.lm_head.weight = nn.Parameter(dequantized(w, 4, 128).float())
    windows = eval_windows(
        tok, read_text(cfg.data.eval.source, role="eval"), cfg.eval.seqlen, cfg.eval.windows
    )
    ref = evaluate(model, windows)
    assert abs(report["ppl"] - ref["ppl"]) / ref["ppl"] < 1e-4
    with pytest.raises(CompressError, match="quant.lm_head='int3'"):
        validate(compose("rtn_int4", [*overrides[:-1], "quant.lm_head=int3"]))
    with pytest.raises(CompressError, match="needs decode.dtype=bfloat16"):
        validate(compose("rtn_int4", [*overrides, "decode.lean=true"]))


def test_cli_fast_default_and_the_bit_faithful_path(tmp_path):
    from compress.decoder.__main__ import configuration, parse_args
    from compress.methods.quant.rtn import pack_model, quantization_config
    from tests.test_decoder import save, tiny_hf

    fp = save(tiny_hf(), tmp_path / "fp")
    q4 = save(
        pack_model(tiny_hf(), 4, 32),
        tmp_path / "q4",
        quantization_config=quantization_config(4, 32),
    )

    def conf(*argv):
        return configuration(parse_args([*argv, "--prompt", "x", "--device", "cpu"]))

    from compress.decoder.runtime import FAST_KERNEL, RuntimeConfig

    fast = conf(str(q4))
    assert fast == RuntimeConfig(
        dtype="bfloat16",
        qdtype="bfloat16",
        lean=True,
        compile=True,
        head="none",  # the fast head (int8) needs a vocabulary of whole words of 32 rows, not 300
        kernel=FAST_KERNEL,
        fast=True,
    )
    faithful = conf(str(q4), "--dtype", "float32")
    assert faithful == RuntimeConfig(dtype="float32", qdtype="float32", kernel="exact")
    # naming one setting keeps the fast choice for the others
    named = conf(str(q4), "--dtype", "bfloat16", "--no-compile")
    assert named == RuntimeConfig(**{**fast.as_dict(), "compile": False})
    assert conf(str(q4), "--qdtype", "float32") == RuntimeConfig(
        **{**fast.as_dict(), "qdtype": "float32", "lean": False}
    )
    assert conf(str(q4), "--threads", "1").threads == 1
    exact = conf(str(q4), "--kernel", "exact", "--head", "none")
    assert exact == RuntimeConfig(**{**fast.as_dict(), "kernel": "exact"})
    assert conf(str(q4), "--kv", "packkv").compile is False  # the static step needs fp16/full
    assert conf(str(q4), "--no-compile", "--kernel", "exact").compile is False
    assert conf(str(fp)).dtype == "float32" and not conf(str(fp)).fast
    (q4 / "manifest.json").write_text(json.dumps({"recipe": {"quant": {"lm_head": "int8"}}}))
    assert conf(str(q4)).head == "int8" and conf(str(q4), "--head", "none").head == "none"

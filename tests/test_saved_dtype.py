"""Quantized run folders save their unquantized tensors in float16 (AutoAWQ's rule), or in the
source's 16-bit dtype; weight_bytes counts what is on disk; evaluation sees what was saved."""

import json

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from compress.arch.adapters import get_adapter
from compress.io.checkpoint import load_run, save_checkpoint, unquantized_dtype
from compress.recipe.pipeline import Context, run
from tests.conftest import TINY_OVERRIDES, compose, make_tiny_model

LINEAR_PARTS = ("weight_packed", "weight_zero_point", "weight_scale", "weight_shape")


def logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits.double()


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def round_unquantized(model, dtype=torch.float16):
    """The in-memory model, every tensor outside the quantized layers rounded through ``dtype``."""
    quantized = {
        n
        for n, m in get_adapter(model.config).all_linears(model).items()
        if not isinstance(m, torch.nn.Linear)
    }
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not any(name.startswith(q + ".") for q in quantized):
                p.copy_(p.to(dtype).float())
    return model


def file_bytes(path):
    """Bytes of every tensor in a safetensors file, read from the file's own header."""
    with safe_open(str(path), "pt") as f:
        return sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())


def test_rtn_int4_folder_is_fp16_outside_the_quantized_linears(tiny_dir, tmp_path):
    out = tmp_path / "run"
    over = [f"model.path={tiny_dir}", *TINY_OVERRIDES, "decode.enabled=false"]
    report = run(compose("rtn_int4", over), out)
    t = load_file(str(out / "model.safetensors"))
    for name, v in t.items():
        if name.rsplit(".", 1)[-1] in ("weight_packed", "weight_zero_point"):
            assert v.dtype == torch.int32, name
        elif name.endswith(".weight_shape"):
            assert v.dtype == torch.int64, name
        else:  # embedding, norms, and the fp16 group scales
            assert v.dtype == torch.float16, name
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "float16"
    assert report["weight_bytes"] == file_bytes(out / "model.safetensors")
    assert report["linear_weight_bytes"] == sum(
        v.numel() * v.element_size() for k, v in t.items() if k.rsplit(".", 1)[-1] in LINEAR_PARTS
    )
    # the source's embedding in fp16: the saved one is exactly its rounding
    src = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert torch.equal(t["model.embed_tokens.weight"], src.model.embed_tokens.weight.half())


def test_bf16_source_keeps_bf16(tiny_dir, tmp_path, tokenizer):
    folder = tmp_path / "bf16"
    make_tiny_model().to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = tmp_path / "run"
    run(compose("rtn_int8", [f"model.path={folder}", *TINY_OVERRIDES, "decode.enabled=false"]), out)
    t = load_file(str(out / "model.safetensors"))
    assert t["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert t["model.norm.weight"].dtype == torch.bfloat16
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_out_of_fp16_range_goes_to_bf16():
    model = make_tiny_model()
    assert unquantized_dtype(model) == torch.float16
    with torch.no_grad():
        model.model.norm.weight[3] = 1e5  # beyond float16's 65504
    assert unquantized_dtype(model) == torch.bfloat16
    assert unquantized_dtype(model, "float16") == torch.float16  # a 16-bit source keeps its dtype


def test_awq_saved_model_is_the_in_memory_one_with_fp16_norms(tiny_dir, tmp_path, tokenizer):
    """AWQ folds its scales into the norms in fp32; the saved fp16 norms are their rounding, and the
    loaded folder computes exactly what the in-memory model computes with those rounded norms."""
    from compress.methods.quant.awq import awq

    cfg = compose("awq_int4", [f"model.path={tiny_dir}", *TINY_OVERRIDES, "awq.batch=2"])
    model = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    ctx = Context(cfg=cfg, tokenizer=tokenizer)
    model = awq(model, ctx)
    dtype = unquantized_dtype(model)
    assert dtype == torch.float16
    save_checkpoint(model, tokenizer, tmp_path / "awq", ctx.quantization_config, dtype)
    loaded, _ = load_run(tmp_path / "awq")

    tokens = torch.randint(0, 49152, (2, 64), generator=torch.Generator().manual_seed(3))
    in_memory = logits(model, tokens)
    saved = logits(loaded, tokens)
    rounded = logits(round_unquantized(model), tokens)
    assert rel_err(saved, rounded) < 1e-6  # the same computation
    assert rel_err(saved, in_memory) < 1e-2  # what fp16 norms and embedding cost


def test_llm_int8_keeps_scb_in_fp32(tiny_dir, tmp_path):
    out = tmp_path / "run"
    over = [f"model.path={tiny_dir}", *TINY_OVERRIDES, "decode.enabled=false"]
    run(compose("llm_int8", over), out)
    t = load_file(str(out / "model.safetensors"))
    p = "model.layers.0.mlp.down_proj."
    assert t[p + "weight"].dtype == torch.int8 and t[p + "SCB"].dtype == torch.float32
    assert t["model.embed_tokens.weight"].dtype == torch.float16
    # transformers (bitsandbytes) loads the fp16 folder as it is and computes what ours does
    hf = AutoModelForCausalLM.from_pretrained(out, device_map="cpu")
    assert hf.model.embed_tokens.weight.dtype == torch.float16
    ours, _ = load_run(out)
    tokens = torch.randint(0, 49152, (1, 32), generator=torch.Generator().manual_seed(4))
    assert (
        rel_err(logits(hf, tokens), logits(ours, tokens)) < 3e-2
    )  # int8 activations, fp16 vs fp32

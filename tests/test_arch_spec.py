"""The architecture spec (``compress.arch.spec``) against transformers' own modules built from the same
config, and the refusals of what the decoder cannot run, before any weight is read."""

import json

import pytest
import torch

from compress.arch.adapters import ADAPTERS, get_adapter
from compress.arch.spec import spec_of
from compress.decoder.model import load, rope_inv_freq
from compress.errors import CompressError
from tests.test_family_exactness import FAMILIES, family_config


@pytest.mark.parametrize("family", FAMILIES)
def test_spec_agrees_with_transformers_modules(family):
    from transformers import AutoModelForCausalLM

    config = family_config(family)
    spec = spec_of(config)
    hf = AutoModelForCausalLM.from_config(config)
    a = spec.adapter
    assert spec.family == family and a is get_adapter(config)
    assert spec.tied == (hf.lm_head.weight is hf.model.embed_tokens.weight)
    scale = getattr(hf.model.embed_tokens, "scalar_embed_scale", None)
    assert spec.embed_scale == scale
    rot = hf.model.rotary_emb
    for i, (layer, ls) in enumerate(zip(hf.model.layers, spec.layers)):
        attn = layer.self_attn
        assert ls.index == i and ls.writes_kv and ls.kv_slot == i
        assert spec.attn_scale == pytest.approx(attn.scaling)
        window = getattr(attn, "sliding_window", getattr(config, "sliding_window", None))
        assert ls.window == window
        assert (attn.q_proj.bias is not None, attn.o_proj.bias is not None) == (
            spec.qkv_bias,
            spec.o_bias,
        )
        assert spec.qk_norm == hasattr(attn, "q_norm")
        if spec.qk_norm:
            assert attn.q_norm is layer.get_submodule(a.q_norm)
            assert attn.k_norm is layer.get_submodule(a.k_norm)
        hf_norms = [n for n, m in layer.named_children() if "norm" in n]
        assert sorted(a.norms()) == sorted(hf_norms)
        assert spec.sandwich == (len(hf_norms) == 4)
        x = torch.randn(3, 5)
        act = {
            "silu": torch.nn.functional.silu,
            "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
        }
        assert torch.allclose(layer.mlp.act_fn(x), act[spec.activation](x))
        kind = getattr(config, "layer_types", None)
        freq = getattr(rot, f"{kind[i]}_inv_freq", None) if kind else None
        freq = rot.inv_freq if freq is None else freq
        assert torch.allclose(rope_inv_freq(spec.head_dim, ls.rope_parameters()), freq)
    # the norm kind: transformers' (1 + w) against w, on a weight of 0.5
    norm = hf.model.norm
    with torch.no_grad():
        norm.weight.fill_(0.5)
    x = torch.randn(2, spec.hidden_size)
    xhat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + spec.norm_eps)
    assert torch.allclose(norm(x), (spec.norm_offset + 0.5) * xhat, atol=1e-6)


def test_gemma3_spec_layer_kinds():
    """Five local layers of six (the config's default pattern), local and global RoPE."""
    from transformers import Gemma3TextConfig

    spec = spec_of(Gemma3TextConfig(num_hidden_layers=12, sliding_window=512))
    assert [ls.window for ls in spec.layers] == ([512] * 5 + [None]) * 2
    assert [dict(r)["rope_theta"] for r in spec.rope_groups()] == [10000.0, 1e6]
    assert spec.slot_windows() == [ls.window for ls in spec.layers] and spec.windowed


def test_unsupported_family_names_supported_ones(tmp_path):
    from transformers import GPT2Config

    with pytest.raises(CompressError) as e:
        spec_of(GPT2Config())
    msg = str(e.value)
    assert "'gpt2'" in msg and "Adapter entry" in msg
    assert all(name in msg for name in ADAPTERS)
    assert "qwen3" in msg and "gemma3_text" in msg


def write_config(folder, config, **raw):
    """A folder with config.json only: loading must fail on the config, before any weight."""
    folder.mkdir()
    d = config.to_dict()
    d.update(raw)
    (folder / "config.json").write_text(json.dumps(d))
    return folder


@pytest.mark.parametrize(
    "family, raw, match",
    [
        ("llama", {"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        (
            "llama",
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}},
            "RoPE type 'yarn'",
        ),
        ("gemma3_text", {"attn_logit_softcapping": 50.0}, "softcaps attention"),
        ("mistral", {"sliding_window": 0}, "sliding_window=0"),
        ("qwen3", {"hidden_act": "relu"}, "activation hidden_act='relu'"),
        (
            "gemma3_text",
            {"layer_types": ["chunked_attention"] * 4},
            "layer type 'chunked_attention'",
        ),
    ],
)
def test_refused_before_loading_weights(tmp_path, family, raw, match):
    folder = write_config(tmp_path / "m", family_config(family), **raw)
    with pytest.raises(CompressError, match=match) as e:
        load(folder)
    assert "safetensors" not in str(e.value)


def test_cla_groups_must_share_a_window():
    from compress.formats.attention.configuration_cla import CLAConfig

    cfg = CLAConfig(
        cla_share=2, num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, vocab_size=64,
    )  # fmt: skip
    assert [ls.kv_slot for ls in spec_of(cfg).layers] == [0, 0, 1, 1]
    cfg.sliding_window, cfg.layer_types = 8, ["sliding_attention", "full_attention"] * 2
    with pytest.raises(CompressError, match="sliding window differs"):
        spec_of(cfg)

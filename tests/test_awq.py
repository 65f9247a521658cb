"""AWQ: clip search against llm-awq's brute-force formulation, scale folding, the search's
effect on activation outliers, and the saved INT4 checkpoint against the AutoAWQ spec."""

import json

import torch
from torch import nn

from compress.formats.quantizer import fake_quantize
from compress.methods.quant import awq as awq_mod
from compress.methods.quant.awq import apply_scale, search_clip, search_scale
from tests.conftest import TINY_OVERRIDES, compose, make_tiny_model
from tests.test_packing import decode_awq_spec


def clip_reference(w, x, bits, g, n_grid=20, max_shrink=0.5):
    """llm-awq auto_clip_layer, elementwise over [co, n_token, n_group, g], in float64."""
    w, x = w.double(), x.double()
    xg = x.reshape(1, x.shape[0], -1, g)
    wg = w.reshape(w.shape[0], 1, -1, g)
    org_max = wg.abs().amax(-1, keepdim=True)
    best, best_err = org_max.clone(), torch.full_like(org_max, float("inf"))
    org_out = (xg * wg).sum(-1)
    for i in range(int(max_shrink * n_grid)):
        m = org_max * (1 - i / n_grid)
        q = fake_quantize(torch.clamp(wg, -m, m).reshape(w.shape).float(), bits, g).double()
        err = ((xg * q.reshape(wg.shape)).sum(-1) - org_out).pow(2).mean(1).view(best_err.shape)
        better = err < best_err
        best_err[better], best[better] = err[better], m[better]
    return best.reshape(w.shape[0], -1)


def test_clip_search_matches_reference():
    torch.manual_seed(0)
    w = torch.randn(48, 128) * (1 + 4 * (torch.rand(48, 128) > 0.98))  # a few large weights
    x = torch.randn(256, 128)
    got = search_clip(w, x, 3, 32, n_tokens=256)
    ref = clip_reference(w, x, 3, 32)
    assert got.shape == (48, 4)
    # the same choice everywhere except float ties between near-equal candidates
    assert (got.double() - ref).abs().le(1e-4 * ref.abs()).float().mean() > 0.97
    assert (got <= w.abs().reshape(48, 4, 32).amax(-1) + 1e-6).all()


def test_apply_scale_preserves_function():
    torch.manual_seed(1)
    norm = nn.RMSNorm(64)
    norm.weight.data = torch.rand(64) + 0.5
    a, b = nn.Linear(64, 32, bias=False), nn.Linear(64, 16, bias=True)
    up, down = nn.Linear(64, 48, bias=True), nn.Linear(48, 8, bias=False)
    x = torch.randn(10, 64)
    before = (a(norm(x)), b(norm(x)), down(up(x)))
    apply_scale(norm, [a, b], torch.rand(64) + 0.1)
    apply_scale(up, [down], torch.rand(48) + 0.1)
    after = (a(norm(x)), b(norm(x)), down(up(x)))
    for u, v in zip(before, after):
        assert torch.allclose(u, v, rtol=1e-4, atol=1e-5)


def test_scale_search_protects_salient_channels():
    """With a few input channels 20x larger, the search picks alpha > 0 and beats RTN clearly."""
    torch.manual_seed(2)
    lin = nn.Linear(256, 128, bias=False)
    x = torch.randn(512, 256)
    x[:, torch.randperm(256)[:8]] *= 20
    group = dict(name="down", prev=None, linears=[lin], inp="down", block=None)
    s, alpha, losses = search_scale(None, None, group, x, x, {}, 3, 64, False, 20, 64)
    assert alpha > 0 and len(losses) == 20
    assert min(losses) < 0.8 * losses[0]  # losses[0] is alpha = 0, plain RTN
    w0 = lin.weight.data.clone()
    rtn = (x @ fake_quantize(w0, 3, 64).t() - x @ w0.t()).pow(2).mean()
    awq = (x @ (fake_quantize(w0 * s, 3, 64) / s).t() - x @ w0.t()).pow(2).mean()
    assert torch.isclose(awq, torch.tensor(min(losses)), rtol=1e-3)
    assert awq < 0.8 * rtn


def test_awq_saved_int4_reproduces_chosen_weights(tiny_dir, tmp_path, monkeypatch):
    """Decode the saved tensors with the spec decoder: exactly the weights AWQ chose."""
    from safetensors.torch import load_file

    from compress.recipe.pipeline import run

    chosen = {}
    real_quantize = awq_mod.quantize

    def spy(w, bits, g, symmetric=False, clip_max=None):
        qw = real_quantize(w, bits, g, symmetric, clip_max)
        chosen[len(chosen)] = qw.dequantize()
        return qw

    monkeypatch.setattr(awq_mod, "quantize", spy)
    over = [f"model.path={tiny_dir}", *TINY_OVERRIDES, "awq.batch=2", "quant.format=autoawq"]
    cfg = compose("awq_int4", over)
    report = run(cfg, tmp_path / "run")
    qcfg = json.loads((tmp_path / "run" / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "awq" and qcfg["version"] == "gemm" and qcfg["group_size"] == 128
    t = load_file(str(tmp_path / "run" / "model.safetensors"))
    names = [
        f"model.layers.{i}.{p}"
        for i in range(2)
        for p in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    ]
    assert len(chosen) == len(names)
    for i, name in enumerate(names):
        q = decode_awq_spec(t[name + ".qweight"])
        z = decode_awq_spec(t[name + ".qzeros"]).repeat_interleave(128, 0)
        s = t[name + ".scales"].float().repeat_interleave(128, 0)
        assert torch.equal(((q - z).float() * s).t(), chosen[i]), name
    assert set(report["awq_alpha"][0]) == {"qkv", "gate_up", "down"}  # GQA: no v->o group

    # perplexity of the loaded packed checkpoint = that of the same model with W_hat in nn.Linear
    from compress.arch.adapters import set_module
    from compress.eval.perplexity import evaluate
    from compress.io.checkpoint import load_run

    packed, _ = load_run(tmp_path / "run")
    fake, _ = load_run(tmp_path / "run")
    for i, name in enumerate(names):
        lin = nn.Linear(chosen[i].shape[1], chosen[i].shape[0], bias=False)
        lin.weight.data = chosen[i]
        set_module(fake, name, lin)
    windows = torch.randint(0, 49152, (2, 64), generator=torch.Generator().manual_seed(1))
    a, b = evaluate(packed, windows)["ppl"], evaluate(fake, windows)["ppl"]
    assert abs(a - b) / b < 1e-3


def test_awq_beats_rtn_on_tiny_model(tiny_dir, tmp_path):
    """On the same calibration-free eval windows, AWQ INT3's KL to the source is below RTN's."""
    from compress.recipe.pipeline import run

    over = [f"model.path={tiny_dir}", *TINY_OVERRIDES, "eval.windows=4"]
    awq = run(compose("awq_int3", over + ["awq.batch=2"]), tmp_path / "awq")
    rtn = run(compose("rtn_int3", over), tmp_path / "rtn")
    assert awq["kl_vs_source"] < rtn["kl_vs_source"]


def test_v_to_o_group_when_shapes_match():
    model = make_tiny_model(num_key_value_heads=4)
    from compress.arch.adapters import get_adapter

    names = [
        g["name"] for g in awq_mod.scale_groups(model.model.layers[0], get_adapter(model.config))
    ]
    assert names == ["qkv", "o", "gate_up", "down"]

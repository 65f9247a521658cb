"""Attention conversion (compress/methods/attn/): gqa, cla, mla against float64 references, the
transformers formats, and the bad inputs."""

import json
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from compress.errors import CompressError
from compress.formats.attention import folder_files
from compress.formats.attention.absorb import absorb_output, absorb_query, expand_kv
from compress.io.checkpoint import load_run, save_checkpoint
from compress.methods.attn.checks import check_rope
from compress.methods.attn.cla import convert_cla
from compress.methods.attn.gqa import aligned_pool_kv, mean_pool_kv
from compress.methods.attn.mla import convert_mla
from compress.methods.attn.rope_select import qk_pair_scores, select_pairs
from tests.conftest import make_tiny_model

VOCAB = 49152


def ids(n=24, batch=2, seed=1):
    return torch.randint(0, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ---- a float64 Llama, written from the equations, with the conversions' options -----------------


def reference_logits(model, tokens, kv=None, kv_layer=None, rope_keep=None):
    """Logits of ``model``'s weights in float64 for one sequence ``tokens [t]``.

    kv:        {layer: (W_k, W_v)} replacing the layer's K/V projections (any number of heads)
    kv_layer:  [layers] the layer whose K/V each layer attends with (cross-layer attention)
    rope_keep: [layers, G, D/2] bools: which frequency pairs RoPE rotates (others: not rotated)
    """
    cfg = model.config
    sd = {k: v.double() for k, v in model.state_dict().items()}
    H, D, L = cfg.num_attention_heads, cfg.head_dim, cfg.num_hidden_layers
    theta = cfg.rope_parameters["rope_theta"]
    t = tokens.shape[0]
    ang = torch.arange(t, dtype=torch.float64)[:, None] / theta ** (
        torch.arange(0, D, 2, dtype=torch.float64) / D
    )
    cos, sin = ang.cos(), ang.sin()  # [t, D/2]

    def rope(v, keep):  # v [heads, t, D]; keep [heads, D/2]
        x1, x2 = v[..., : D // 2], v[..., D // 2 :]
        c = torch.where(keep[:, None], cos, torch.ones_like(cos))
        s = torch.where(keep[:, None], sin, torch.zeros_like(sin))
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

    def rms(x, w):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w

    x = sd["model.embed_tokens.weight"][tokens]
    mask = torch.full((t, t), float("-inf"), dtype=torch.float64).triu(1)
    cache = {}
    for i in range(L):
        p = f"model.layers.{i}."
        h = rms(x, sd[p + "input_layernorm.weight"])
        src = kv_layer[i] if kv_layer is not None else i
        if src == i:
            wk, wv = (
                kv[i]
                if kv and i in kv
                else (sd[p + "self_attn.k_proj.weight"], sd[p + "self_attn.v_proj.weight"])
            )
            G = wk.shape[0] // D
            keep = (
                rope_keep[i] if rope_keep is not None else torch.ones(G, D // 2, dtype=torch.bool)
            )
            k = rope((h @ wk.double().T).view(t, G, D).transpose(0, 1), keep)
            v = (h @ wv.double().T).view(t, G, D).transpose(0, 1)
            cache[i] = (k, v, keep)
        k, v, keep = cache[src]
        G = k.shape[0]
        q = rope(
            (h @ sd[p + "self_attn.q_proj.weight"].T).view(t, H, D).transpose(0, 1),
            keep.repeat_interleave(H // G, 0),
        )
        k, v = k.repeat_interleave(H // G, 0), v.repeat_interleave(H // G, 0)
        att = torch.softmax(q @ k.transpose(1, 2) / D**0.5 + mask, dim=-1) @ v
        x = x + att.transpose(0, 1).reshape(t, H * D) @ sd[p + "self_attn.o_proj.weight"].T
        h = rms(x, sd[p + "post_attention_layernorm.weight"])
        gate, up = h @ sd[p + "mlp.gate_proj.weight"].T, h @ sd[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    return rms(x, sd["model.norm.weight"]) @ sd["model.embed_tokens.weight"].T


def attention_inputs_f64(model, tokens):
    """Every layer's attention input, from transformers' hidden states (independent of hooks)."""
    with torch.no_grad():
        hs = model(tokens, output_hidden_states=True).hidden_states
    return [
        layer.input_layernorm(hs[i]).reshape(-1, hs[i].shape[-1]).double()
        for i, layer in enumerate(model.model.layers)
    ]


# ---- gqa ------------------------------------------------------------------------------------


def test_gqa_same_kv_heads_is_the_source():
    model = make_tiny_model()
    x = ids()
    ref = model(x).logits
    assert torch.equal(mean_pool_kv(model, 2)(x).logits, ref)


@pytest.mark.parametrize("heads,kv", [(4, 4), (4, 2)])  # from MHA and from GQA
def test_mqa_equals_mean_pooled_float64(heads, kv):
    model = make_tiny_model(num_attention_heads=heads, num_key_value_heads=kv)
    x = ids(batch=1)
    D = model.config.head_dim
    pooled = {
        i: tuple(
            layer.self_attn.get_submodule(n).weight.detach().double().view(kv, D, -1).mean(0)
            for n in ("k_proj", "v_proj")
        )
        for i, layer in enumerate(model.model.layers)
    }
    ref = reference_logits(model, x[0], kv=pooled)
    mqa = mean_pool_kv(model, 1)
    assert mqa.config.num_key_value_heads == 1
    assert mqa.model.layers[0].self_attn.k_proj.weight.shape == (D, model.config.hidden_size)
    assert rel(mqa(x).logits[0], ref) < 1e-5


def test_gqa_folder_is_plain_llama(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM

    model = mean_pool_kv(make_tiny_model(), 1)
    save_checkpoint(model, tokenizer, tmp_path, None)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)  # no remote code
    x = ids()
    assert rel(loaded(x).logits, model(x).logits) < 1e-6


# ---- cla ------------------------------------------------------------------------------------


def test_cla_first_matches_float64_cross_layer_attention():
    model = make_tiny_model(num_hidden_layers=4)
    x = ids(batch=1)
    ref = reference_logits(model, x[0], kv_layer=[0, 0, 2, 2])
    cla = convert_cla(model, 2, "first")
    assert rel(cla(x).logits[0], ref) < 1e-5
    names = set(cla.state_dict())
    for i in range(4):
        assert (f"model.layers.{i}.self_attn.k_proj.weight" in names) == (i % 2 == 0)
        assert (f"model.layers.{i}.self_attn.v_proj.weight" in names) == (i % 2 == 0)


def test_cla_lstsq_solves_the_stacked_least_squares():
    model = make_tiny_model(num_hidden_layers=4)
    calib = ids(n=48, batch=4, seed=3)
    xs = attention_inputs_f64(model, calib)
    cla = convert_cla(model, 2, "lstsq", calib)
    for f in (0, 2):
        for name in ("k_proj", "v_proj"):
            ws = [
                model.model.layers[i].self_attn.get_submodule(name).weight.double()
                for i in (f, f + 1)
            ]
            a = torch.cat((xs[f], xs[f]))
            b = torch.cat((xs[f] @ ws[0].T, xs[f + 1] @ ws[1].T))
            expected = torch.linalg.lstsq(a, b).solution.T
            got = cla.model.layers[f].self_attn.get_submodule(name).weight.double()
            assert rel(got, expected) < 1e-4


def test_cla_share_one_is_the_source():
    model = make_tiny_model()
    x = ids()
    assert rel(convert_cla(model, 1, "lstsq")(x).logits, model(x).logits) < 1e-6


def test_cla_cache_holds_first_layers_only():
    cla = convert_cla(make_tiny_model(num_hidden_layers=4), 2, "first")
    x = ids(n=12, batch=1)
    full = cla(x).logits
    out = cla(x[:, :8], use_cache=True)
    step = cla(x[:, 8:], cache=out.past_key_values, use_cache=True)
    assert rel(step.logits, full[:, 8:]) < 1e-5
    filled = [layer.is_initialized for layer in step.past_key_values.layers]
    assert filled == [True, False, True, False]


# ---- mla ------------------------------------------------------------------------------------


@pytest.mark.parametrize("heads,kv", [(4, 4), (4, 2)])
def test_mla_full_rank_all_pairs_is_the_source(heads, kv):
    model = make_tiny_model(num_attention_heads=heads, num_key_value_heads=kv)
    D = model.config.head_dim
    x = ids()
    mla = convert_mla(model, d_kv=D, rope_pairs=D // 2, rope_select="2norm", tokens=x)
    assert rel(mla(x).logits, model(x).logits) < 1e-4


def test_mla_partial_rope_full_rank_matches_float64():
    """Full rank, 4 of 16 pairs per KV head rotated (each head its own pairs): the reference
    rotates exactly those pairs of q and k and leaves the rest unrotated."""
    model = make_tiny_model()
    D, G = model.config.head_dim, model.config.num_key_value_heads
    with torch.no_grad():  # KV heads 0 and 1 of layer 0 favour different pairs (2 and 13)
        k = model.model.layers[0].self_attn.k_proj.weight.view(G, D, -1)
        k[0, [2, 2 + D // 2]] *= 20
        k[1, [13, 13 + D // 2]] *= 20
    calib, x = ids(n=32, batch=4, seed=5), ids(batch=1)
    mla = convert_mla(model, d_kv=2 * D - 8, rope_pairs=4, rope_select="2norm", tokens=calib)
    keep = torch.zeros(2, G, D // 2, dtype=torch.bool)
    for i, layer in enumerate(mla.model.layers):
        keep[i].scatter_(1, layer.self_attn.rope_index, True)
    assert keep.sum() == 2 * G * 4 and keep[0, 0, 2] and keep[0, 1, 13]
    assert not torch.equal(keep[0, 0], keep[0, 1])
    ref = reference_logits(model, x[0], rope_keep=keep)
    assert rel(mla(x).logits[0], ref) < 1e-5


def test_mla_truncation_error_is_the_discarded_spectrum():
    """Eckart-Young: the rank-L joint K/V loses exactly the singular values past L."""
    model = make_tiny_model()
    D, G, p, d_kv = model.config.head_dim, model.config.num_key_value_heads, 4, 16
    mla = convert_mla(model, d_kv=d_kv, rope_pairs=p, rope_select="high")
    attn, src = mla.model.layers[1].self_attn, model.model.layers[1].self_attn
    keep = [j for j in range(D) if j % (D // 2) >= p]  # "high" keeps pairs 0..p-1
    wk = src.k_proj.weight.view(G, D, -1)[:, keep].reshape(-1, model.config.hidden_size)
    target = torch.cat((wk, src.v_proj.weight)).double()
    up = torch.cat((attn.k_b_proj.weight, attn.v_b_proj.weight)).double()
    approx = up @ attn.kv_a_proj.weight.double()
    s = torch.linalg.svdvals(target)
    assert abs((target - approx).norm() ** 2 / s[G * d_kv :].pow(2).sum() - 1) < 1e-4
    rope = src.k_proj.weight.view(G, D, -1)[:, [j for j in range(D) if j % (D // 2) < p]]
    assert torch.equal(attn.k_rope_proj.weight, rope.reshape(-1, model.config.hidden_size))


def test_mla_activation_svd_minimises_the_kv_error_on_calibration_text():
    """svd=activations: ||X (W - up down)^T||^2 on the calibration inputs X is the tail of
    X W^T's spectrum (Eckart-Young), below what the weight-space SVD leaves."""
    model = make_tiny_model()
    D, G, p, d_kv = model.config.head_dim, model.config.num_key_value_heads, 4, 8
    calib = ids(n=64, batch=4, seed=7)
    xs = attention_inputs_f64(model, calib)
    keep = [j for j in range(D) if j % (D // 2) >= p]
    errors = {}
    for svd in ("activations", "weights"):
        attn = convert_mla(model, d_kv, p, "high", calib, svd=svd).model.layers[1].self_attn
        src = model.model.layers[1].self_attn
        w = torch.cat(
            (
                src.k_proj.weight.view(G, D, -1)[:, keep].reshape(G * (D - 2 * p), -1),
                src.v_proj.weight,
            )
        ).double()
        up = torch.cat((attn.k_b_proj.weight, attn.v_b_proj.weight)).double()
        approx = up @ attn.kv_a_proj.weight.double()
        errors[svd] = (xs[1] @ (w - approx).T).norm() ** 2
    tail = torch.linalg.svdvals(xs[1] @ w.T)[G * d_kv :].pow(2).sum()
    assert abs(errors["activations"] / tail - 1) < 1e-3
    assert errors["activations"] < errors["weights"]


def test_rope_select_fixed_methods():
    config = make_tiny_model().config  # head_dim 32: 16 pairs
    assert select_pairs(config, 4, "high")[0, 0].tolist() == [0, 1, 2, 3]
    assert select_pairs(config, 4, "low")[1, 1].tolist() == [12, 13, 14, 15]
    assert select_pairs(config, 4, "uniform")[0, 1].tolist() == [0, 4, 8, 12]


def test_2norm_scores_match_the_formula():
    model = make_tiny_model()
    H, G, D = 4, 2, model.config.head_dim
    with torch.no_grad():  # make pair 7 of KV head 1 in layer 0 dominant
        model.model.layers[0].self_attn.k_proj.weight.view(G, D, -1)[1, [7, 7 + D // 2]] *= 50
    x = ids(n=32, batch=2)
    scores = qk_pair_scores(model, x)
    for i, h in enumerate(attention_inputs_f64(model, x)):
        attn = model.model.layers[i].self_attn
        q = (h @ attn.q_proj.weight.double().T).view(-1, H, 2, D // 2).norm(dim=2).mean(0)
        k = (h @ attn.k_proj.weight.double().T).view(-1, G, 2, D // 2).norm(dim=2).mean(0)
        assert rel(scores[i], k * q.view(G, H // G, -1).sum(1)) < 1e-6
    assert 7 in select_pairs(model.config, 4, "2norm", scores)[0, 1].tolist()


def test_mla_cache_is_latent_and_rope_key():
    model = make_tiny_model()
    mla = convert_mla(model, d_kv=16, rope_pairs=4, rope_select="uniform")
    x = ids(n=12, batch=1)
    full = mla(x).logits
    out = mla(x[:, :8], use_cache=True)
    step = mla(x[:, 8:], cache=out.past_key_values, use_cache=True)
    assert rel(step.logits, full[:, 8:]) < 1e-5
    layer = step.past_key_values.layers[0]
    assert layer.keys.shape == (1, 2, 12, 8) and layer.values.shape == (1, 1, 12, 2 * 16)


def test_absorbed_attention_equals_expanded():
    """One decode step over T cached tokens: the absorbed form (fp32) against the expanded
    form in float64, on random weights and inputs."""
    g = torch.Generator().manual_seed(0)
    H, G, D, p, L, T, hidden = 6, 2, 16, 2, 12, 40, 48
    n = D - 2 * p
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    c, k_r, k_b, v_b, o = r(T, L), r(G, T, 2 * p), r(G * n, L), r(G * D, L), r(hidden, H * D)
    q = r(H, 1, D)  # RoPE already applied to q[..., :2p] and k_r

    # expanded, float64
    k_n, v = expand_kv(c, k_b, v_b, G)
    k = torch.cat((k_r, k_n), -1).repeat_interleave(H // G, 0)
    w = torch.softmax(q @ k.transpose(1, 2) / D**0.5, -1)
    ref = (w @ v.repeat_interleave(H // G, 0)).transpose(0, 1).reshape(1, H * D) @ o.T

    # absorbed, float32: scores against c directly, output through W_ol
    f = lambda t: t.float()  # noqa: E731
    q_lat = absorb_query(f(q[..., 2 * p :]), f(k_b), G)  # [H, 1, L]
    score = (
        f(q[..., : 2 * p]) @ f(k_r).repeat_interleave(H // G, 0).transpose(1, 2) + q_lat @ f(c).T
    ) / D**0.5
    u = torch.softmax(score, -1) @ f(c)  # [H, 1, L]
    out = u.transpose(0, 1).reshape(1, H * L) @ absorb_output(f(o), f(v_b), H).T
    assert rel(out, ref) < 1e-5


# ---- transformers round trip -------------------------------------------------------------


def save_converted(model, tokenizer, folder):
    save_checkpoint(model, tokenizer, folder, None)
    for name, src in folder_files(model.config.model_type).items():
        shutil.copyfile(src, folder / name)


@pytest.mark.parametrize("kind", ["cla", "mla"])
def test_from_pretrained_remote_code_equals_in_memory(kind, tmp_path, tokenizer):
    model = make_tiny_model(num_hidden_layers=4)
    x = ids(n=40)
    converted = (
        convert_cla(model, 2, "lstsq", x)
        if kind == "cla"
        else convert_mla(model, 16, 4, "2norm", x)
    )
    save_converted(converted, tokenizer, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == f"compress_{kind}" and "AutoModelForCausalLM" in raw["auto_map"]
    torch.save(x, tmp_path / "ids.pt")
    # a user's process, without compress imported: the folder's own modeling file must run
    script = (
        "import sys, torch; from transformers import AutoModelForCausalLM; "
        "m = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True); "
        "assert 'compress' not in sys.modules; "
        "assert type(m).__module__.startswith('transformers_modules'); "
        "torch.save(m(torch.load(sys.argv[2])).logits, sys.argv[3])"
    )
    subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            str(tmp_path),
            str(tmp_path / "ids.pt"),
            str(tmp_path / "logits.pt"),
        ],
        check=True,
        cwd=tmp_path,
        timeout=300,
    )
    ours, _ = load_run(tmp_path)
    ref = converted(x).logits
    assert rel(torch.load(tmp_path / "logits.pt"), ref) < 1e-4
    assert rel(ours(x).logits, ref) < 1e-6


# ---- bad input ----------------------------------------------------------------------------


def test_check_rope_refuses_no_rope_and_unknown_types():
    with pytest.raises(CompressError, match="rotary position"):
        check_rope(SimpleNamespace(rope_parameters={}), "mla")
    with pytest.raises(CompressError, match="yarn"):
        check_rope(SimpleNamespace(rope_parameters={"rope_theta": 1e4, "rope_type": "yarn"}), "mla")


def test_direct_calls_refuse_bad_sizes():
    model = make_tiny_model()
    with pytest.raises(CompressError, match="valid values: 1, 2"):
        mean_pool_kv(model, 3)
    with pytest.raises(CompressError, match="valid values: 1, 2"):
        convert_cla(model, 3, "first")
    with pytest.raises(CompressError, match="full rank"):
        convert_mla(model, d_kv=57, rope_pairs=4, rope_select="high")
    with pytest.raises(CompressError, match="1..16"):
        convert_mla(model, d_kv=8, rope_pairs=17, rope_select="high")
    with pytest.raises(CompressError, match="rope_select"):
        convert_mla(model, d_kv=8, rope_pairs=4, rope_select="middle")


# ---- the recipes through the pipeline ------------------------------------------------------


def run_recipe(recipe, model_dir, out, *extra):
    from compress.recipe.pipeline import run
    from tests.conftest import TINY_OVERRIDES, compose

    return run(compose(recipe, [f"model.path={model_dir}", *TINY_OVERRIDES, *extra]), out)


@pytest.mark.parametrize("recipe", ["gqa", "cla", "mla"])
def test_recipe_saves_the_converted_model(recipe, tiny_dir, tmp_path, tokenizer):
    """distill.tokens=0 fit.steps=0: the run folder holds the conversion of the source on the
    recipe's calibration text, and the built-in decoder measures its cache: exactly the kind's
    bytes."""
    from safetensors.torch import load_file

    from compress.io.data import calib_samples, read_text
    from compress.io.source import load_model
    from tests.conftest import compose, run_bench

    out = tmp_path / "run"
    report = run_recipe(recipe, tiny_dir, out, "distill.tokens=0", "fit.steps=0")
    cfg = compose(recipe, [f"model.path={tiny_dir}", "calib.samples=4", "calib.seqlen=64"])
    calib = calib_samples(tokenizer, read_text(cfg.data.calib.source, role="calib"), 4, 64, seed=0)
    source = load_model(str(tiny_dir))[0]
    expected = {
        "gqa": lambda: aligned_pool_kv(source, 1, calib),
        "cla": lambda: convert_cla(source, 2, "lstsq", calib),
        "mla": lambda: convert_mla(source, 16, 4, "2norm", calib, "activations"),
    }[recipe]()
    ours, _ = load_run(out)
    x = ids()
    assert rel(ours(x).logits, expected(x).logits) < 1e-6
    raw = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    assert report["distill_tokens"] == 0
    card = (out / "README.md").read_text()
    if recipe == "gqa":
        assert "vllm serve" in card and "trust_remote_code=True" not in card
        assert raw["model_type"] == "llama" and raw["num_key_value_heads"] == 1
        assert report["attn"] == {"kv_heads": 1, "source_kv_heads": 2, "gqa_init": "aligned"}
        assert "fit" not in report
        assert report["kv_bytes_per_token"] == 2 * 2 * 1 * 32 * 2  # the decoder runs it: 1 KV head
        # eval/bench/eval_folders.py: the same windows give the report's own figures
        table = run_bench(
            "eval_folders", out, "--source", tiny_dir, "--windows", 2, "--seqlen", 64
        ).stdout
        row = next(line for line in table.splitlines() if line.startswith("| run |"))
        assert (
            f"| {report['ppl']:.3f} | {report['kl_vs_source']:.4f} | {report['top1_vs_source']:.4f} |"
            in row
        ), row
        return
    c = raw  # tiny: 2 layers, 2 KV heads of 32 dims; the decoder's fp16 cache, 2 bytes a value
    per_layer = {
        "cla": 2 * 2 * 32 / 2,
        "mla": c.get("kv_lora_rank", 0) + 2 * c.get("mla_rope_pairs", 0) * 2,
    }
    assert "decode_error" not in report and report["ppl"] > 0
    assert report["kv_bytes_per_token"] == 2 * 2 * per_layer[recipe]
    assert "trust_remote_code=True)" in card and "vllm" not in card
    assert set(raw["auto_map"].values()) == {
        f"{f[:-3]}.{c}"
        for f, c in zip(
            sorted(folder_files(raw["model_type"])),
            ("CLAConfig", "CLAForCausalLM") if recipe == "cla" else ("MLAConfig", "MLAForCausalLM"),
        )
    }
    assert all((out / name).is_file() for name in folder_files(raw["model_type"]))
    if recipe == "cla":
        assert raw["cla_share"] == 2 and report["attn"]["cla_init"] == "lstsq"
        assert "model.layers.0.self_attn.k_proj.weight" in tensors
        assert not any(
            k.startswith("model.layers.1.self_attn.") and ("k_proj" in k or "v_proj" in k)
            for k in tensors
        )
    else:
        assert raw["kv_lora_rank"] == 32 and raw["mla_rope_pairs"] == 4 and raw["mla_d_kv"] == 16
        p = "model.layers.1.self_attn."
        shapes = {
            n: tuple(tensors[p + n].shape)
            for n in (
                "q_proj.weight",
                "k_rope_proj.weight",
                "kv_a_proj.weight",
                "k_b_proj.weight",
                "v_b_proj.weight",
                "o_proj.weight",
                "rope_index",
            )
        }
        assert shapes == {
            "q_proj.weight": (128, 128),
            "k_rope_proj.weight": (16, 128),
            "kv_a_proj.weight": (32, 128),
            "k_b_proj.weight": (48, 32),
            "v_b_proj.weight": (64, 32),
            "o_proj.weight": (128, 128),
            "rope_index": (2, 4),
        }


def test_cla_with_mqa_and_distillation(tiny_dir, tmp_path):
    out = tmp_path / "run"
    report = run_recipe(
        "cla",
        tiny_dir,
        out,
        "attn.kv_heads=1",
        "distill.tokens=64",
        "distill.seqlen=32",
        "distill.grad_accum=1",
        "fit.steps=3",
    )
    assert report["distill_tokens"] == 64 and report["distill"]["steps"] == 2
    assert report["attn"] == {
        "kv_heads": 1, "source_kv_heads": 2, "gqa_init": "aligned", "share": 2, "cla_init": "lstsq",
    }  # fmt: skip
    assert report["fit"]["groups"] == [[0, 1]] and report["fit"]["steps"] == 3
    raw = json.loads((out / "config.json").read_text())
    assert raw["num_key_value_heads"] == 1 and raw["cla_share"] == 2


@pytest.fixture(scope="module")
def odd_dirs(tmp_path_factory, tokenizer):
    """(a cla-converted folder, a tiny Llama with yarn RoPE), each with the tokenizer."""
    root = tmp_path_factory.mktemp("odd")
    save_converted(convert_cla(make_tiny_model(), 2, "first"), tokenizer, root / "cla")
    yarn = make_tiny_model(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 2.0,
            "original_max_position_embeddings": 256,
        }
    )
    yarn.save_pretrained(root / "yarn")
    tokenizer.save_pretrained(root / "yarn")
    return {"cla": root / "cla", "yarn": root / "yarn"}


@pytest.mark.parametrize(
    "recipe,extra,folder,match",
    [
        ("gqa", ["attn.kv_heads=3"], None, "valid values: 1, 2"),
        ("cla", ["attn.share=3"], None, "must divide the model's 2 layers"),
        ("cla", ["attn.cla_init=mean"], None, "cla_init"),
        ("gqa", ["attn.kv_heads=1", "attn.gqa_init=svd"], None, "gqa_init"),
        ("gqa", ["attn.kv_heads=1", "fit.lr=0"], None, "fit.lr"),
        ("cla", ["fit.steps=-2"], None, "fit.steps"),
        ("mla", ["fit.batch=0"], None, "fit.batch"),
        ("mla", ["calib.samples=1"], None, "calib.samples=1"),
        ("mla", ["mla.d_kv=57"], None, "full rank 56"),
        ("mla", ["mla.rope_pairs=17"], None, "rope_pairs=17"),
        ("mla", ["mla.rope_select=middle"], None, "rope_select"),
        ("mla", [], "yarn", "'yarn'"),
        ("cla", [], "cla", "already converted"),
        ("mla", [], "cla", "already converted"),
    ],
)
def test_bad_input_leaves_no_run_folder(recipe, extra, folder, match, tiny_dir, odd_dirs, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(CompressError, match=match):
        run_recipe(
            recipe, odd_dirs[folder] if folder else tiny_dir, out, "distill.tokens=0", *extra
        )
    assert not out.exists() and not list(tmp_path.iterdir())


# ---- our MLA as a stock deepseek_v3 folder ----------------------------------------------------


def test_deepseek_style_is_exact_where_nothing_is_truncated():
    """MQA source, every RoPE pair kept, the latent at full rank: the one shared RoPE key and
    the latent are exact, so with the latent norm made the identity the converted stock
    DeepseekV3ForCausalLM's logits are the source's (the norm alone is not an identity: with it
    the logits differ)."""
    from compress.methods.attn.deepseek_mla import convert_deepseek_mla

    source = make_tiny_model(num_key_value_heads=1)
    D = source.config.head_dim
    out = convert_deepseek_mla(source, rank=D, rope_dim=D, tokens=ids(64, 4))
    x = ids()
    with torch.no_grad():
        normed = out(x).logits
        for layer in out.model.layers:
            layer.self_attn.kv_a_layernorm.forward = lambda t: t
        assert rel(out(x).logits, source(x).logits) < 1e-5
    assert rel(normed, source(x).logits) > 1e-3
    assert type(out).__name__ == "DeepseekV3ForCausalLM"


def test_deepseek_latent_anchor_makes_the_norm_an_identity():
    """With ``anchor`` (latent channel 0 a constant far above the rest) the stock latent RMSNorm
    is the identity on the other channels to about 1e-4: at full rank the converted model's
    logits are the source's, norm and all."""
    from compress.methods.attn.deepseek_mla import convert_deepseek_mla

    source = make_tiny_model(num_key_value_heads=1)
    D = source.config.head_dim
    out = convert_deepseek_mla(source, rank=D + 1, rope_dim=D, tokens=ids(64, 4), anchor=True)
    x = ids()
    with torch.no_grad():
        assert rel(out(x).logits, source(x).logits) < 1e-3
    bias = out.model.layers[0].self_attn.kv_a_proj_with_mqa.bias
    assert bias[0] > 0 and not bias[1:].any()


def test_deepseek_shared_key_is_the_top_component():
    """With G KV heads, the shared key of a pair is the top eigenvector's combination: a source
    whose heads' keys are complex multiples of one another (RoPE-pair-wise) loses nothing."""
    from compress.methods.attn.deepseek_mla import deepseek_layer

    g = torch.Generator().manual_seed(3)
    H, G, D, hidden = 4, 2, 8, 32
    base = torch.randn(D, hidden, generator=g, dtype=torch.float64)
    c = torch.complex(
        torch.randn(D // 2, dtype=torch.float64), torch.randn(D // 2, dtype=torch.float64)
    )
    bc = (
        torch.complex(base[: D // 2], base[D // 2 :]) * c[:, None]
    )  # head 1 = c * head 0, pair-wise
    wk = torch.cat([base, torch.cat([bc.real, bc.imag])])
    wq = torch.randn(H * D, hidden, generator=g, dtype=torch.float64)
    wv = torch.randn(G * D, hidden, generator=g, dtype=torch.float64)
    x = torch.randn(200, hidden, generator=g, dtype=torch.float64)
    gram = x.T @ x / x.shape[0]
    new = deepseek_layer(wq, wk, wv, gram, H, G, rank=G * D, rope_dim=D)
    # scores at one random angle per pair, sum_j Re(q~_j e^(i a_j) conj(k~_j)), against the source

    def pairs(w, heads):  # [heads, D/2] complex projections of x, half-split layout
        y = (x @ w.T).view(-1, heads, D)
        return torch.complex(y[..., : D // 2], y[..., D // 2 :])

    def inter(w, heads, width):  # interleaved rope rows -> complex
        y = (x @ w.T).view(-1, heads, width)[..., -D:]
        return torch.complex(y[..., 0::2], y[..., 1::2])

    angle = torch.exp(1j * torch.rand(D // 2, generator=g, dtype=torch.float64) * 6.28)
    qs, ks = pairs(wq, H), pairs(wk, G)
    want = (qs * angle * ks.conj()[:, torch.arange(H) // 2]).real.sum(-1)
    qn = inter(new["q_proj.weight"], H, D)
    kn = inter(new["kv_a_proj_with_mqa.weight"][-D:], 1, D)
    got = (qn * angle * kn.conj()).real.sum(-1)
    assert rel(got, want) < 1e-10


def test_deepseek_recipe_writes_a_stock_folder(tiny_dir, tmp_path):
    """``recipe=mla mla=deepseek_v3``: a deepseek_v3 folder with the stock config's keys only
    (no auto_map, no modeling files), which transformers loads without trust_remote_code and
    our decoder matches within 1e-4; its cache is the latent plus one RoPE key per token."""
    import transformers
    from transformers import AutoModelForCausalLM

    from compress.decoder.kv import new_cache
    from compress.decoder.model import load

    out = tmp_path / "run"
    report = run_recipe(
        "mla",
        tiny_dir,
        out,
        "mla=deepseek_v3",
        "distill.tokens=0",
        "mla.kv_lora_rank=24",
        "mla.rope_dim=8",
    )
    raw = json.loads((out / "config.json").read_text())
    stock = transformers.DeepseekV3Config().to_dict()
    assert raw["model_type"] == "deepseek_v3" and "auto_map" not in raw
    assert set(raw) <= set(stock) | {"transformers_version", "architectures", "dtype"}, set(
        raw
    ) - set(stock)
    assert not list(out.glob("*.py"))
    assert raw["first_k_dense_replace"] == raw["num_hidden_layers"] and raw["q_lora_rank"] is None
    assert report["attn"] == {
        "style": "deepseek_v3",
        "kv_lora_rank": 24,
        "rope_dim": 8,
        "latent_anchor": True,
    }
    assert raw["attention_bias"] is True  # the anchor is kv_a_proj_with_mqa's bias
    assert report["kv_bytes_per_token"] == 2 * 2 * (24 + 8)  # 2 layers, fp16
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours, _ = load(out)
    x = ids(40, 1)
    with torch.no_grad():
        want = hf(x).logits[0]
        got = ours(x, new_cache(ours, "full", 1, 40))[0]
    assert rel(got, want) < 1e-4

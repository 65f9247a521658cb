"""GPTQ against independent references: the blocked, lazy-batch GPTQ against the textbook OBS
update (float64, one column at a time, the inverse Hessian downdated explicitly, no Cholesky, no
blocks); its error against RTN's on correlated inputs; act-order's static groups in the saved
format; the streamed Hessian against the one-shot float64 one; the stage on tiny models of
several families (folder = in-memory model, true-sequential Hessians); the settings' refusals
and the AWQ -> GPTQ recipes."""

from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from compress.arch.adapters import MLA, get_adapter
from compress.errors import CompressError
from compress.formats.quantizer import fake_quantize
from compress.io.checkpoint import load_run, save_checkpoint
from compress.io.offload import capture_inputs
from compress.layers import QuantLinear
from compress.methods.attn.cla import convert_cla
from compress.methods.attn.mla import convert_mla
from compress.methods.quant import gptq as gptq_mod
from compress.methods.quant.awq import awq
from compress.methods.quant.gptq import Hessian, gptq, gptq_quantize, sequential_steps
from compress.methods.quant.rtn import pack_model
from compress.recipe import pipeline
from compress.recipe.config import check_stage_list, validate
from compress.recipe.pipeline import run
from compress.recipe.stages import get_stage
from tests.conftest import TINY_OVERRIDES, compose, make_tiny_model, run_bench
from tests.family_models import family_config, family_model
from tests.test_methods_families import decoder_logits, hf_logits, rel_err, tokens

# ---- independent references ---------------------------------------------------------------------


def grid(wg, bits, symmetric=False, weight=None, floor=20):
    """Asymmetric min/max grid of the groups along the last axis, fp16 scales (written out);
    ``symmetric``: max|w| / (2^(b-1) - 1), zero point 2^(b-1). ``weight`` (one per column of
    the group): the ``mse`` search, group by group over the shrink factors k/100, k = 100..floor."""
    if weight is not None:
        return searched_grid(wg, bits, symmetric, weight, floor)
    if symmetric:
        s = (wg.abs().amax(-1).clamp(min=1e-5) / (2 ** (bits - 1) - 1)).half().double()
        return s, torch.full_like(s, 2 ** (bits - 1))
    qmax = 2**bits - 1
    lo, hi = wg.amin(-1), wg.amax(-1)
    s = ((hi - lo).clamp(min=1e-5) / qmax).half().double()
    z = (-torch.round(lo / s)).clamp(0, qmax)
    return s, z


def searched_grid(wg, bits, symmetric, weight, floor):
    """The grid of least ``sum_j weight_j (w_j - W_hat_j)^2`` over the shrunk ranges, one group
    (row of ``wg.reshape(-1, c)``) at a time; the first factor wins ties."""
    flat = wg.reshape(-1, wg.shape[-1])
    wt = weight.expand(wg.shape).reshape(flat.shape)
    S, Z = torch.zeros(flat.shape[0], dtype=torch.float64), torch.zeros(flat.shape[0])
    for r in range(flat.shape[0]):
        best = None
        for k in range(100, floor - 1, -1):
            s, z = grid(flat[r] * (k / 100), bits, symmetric)
            q = (torch.round(flat[r] / s) + z).clamp(0, 2**bits - 1)
            err = float((wt[r] * ((q - z) * s - flat[r]) ** 2).sum())
            if best is None or err < best:
                best, S[r], Z[r] = err, s, z
    return S.reshape(wg.shape[:-1]), Z.double().reshape(wg.shape[:-1])


def obs_reference(w, h, bits, g, damp, act_order, symmetric=False, mse=False, floor=20):
    """Textbook OBS/OBQ in float64: columns one at a time, ``Hinv`` the full inverse of the
    damped Hessian, downdated after each column by Gaussian elimination; returns the codes,
    scales and zeros. ``mse``: each group's grid searched with the weights ``diag H``."""
    W, H = w.double().clone(), h.double().clone()
    out_f, n = W.shape
    dead = H.diagonal() == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    diag = H.diagonal().clone()
    S = torch.zeros(out_f, n // g, dtype=torch.float64)
    Z = torch.zeros_like(S)
    if act_order:
        weight = diag.reshape(n // g, g) if mse else None
        S, Z = grid(W.reshape(out_f, n // g, g), bits, symmetric, weight, floor)
        order = torch.argsort(H.diagonal(), descending=True).tolist()
    else:
        order = list(range(n))
    H += damp * H.diagonal().mean() * torch.eye(n, dtype=torch.float64)
    Hinv = torch.linalg.inv(H)
    Q = torch.zeros_like(W)
    for j in order:
        if not act_order and j % g == 0:
            s, z = grid(W[:, j : j + g], bits, symmetric, diag[j : j + g] if mse else None, floor)
            S[:, j // g], Z[:, j // g] = s, z
        s, z = S[:, j // g], Z[:, j // g]
        q = (torch.round(W[:, j] / s) + z).clamp(0, 2**bits - 1)
        d = Hinv[j, j]
        err = (W[:, j] - (q - z) * s) / d
        W -= torch.outer(err, Hinv[j])  # Hinv's removed rows/columns are 0: only F moves
        Hinv = Hinv - torch.outer(Hinv[:, j], Hinv[j]) / d
        Q[:, j] = q
    return Q, S, Z


def dequant(Q, S, Z, g):
    return (Q - Z.repeat_interleave(g, 1)) * S.repeat_interleave(g, 1)


def correlated(n_tokens, n_in, seed, rank=12, noise=0.1):
    """Inputs with strongly correlated channels (low rank plus noise) of uneven scales."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(n_tokens, rank, generator=gen) @ torch.randn(rank, n_in, generator=gen)
    x = base + noise * torch.randn(n_tokens, n_in, generator=gen)
    return x * (0.2 + 2 * torch.rand(n_in, generator=gen))


def hessian64(x):
    x = x.reshape(-1, x.shape[-1]).double()
    return 2 * x.t() @ x / x.shape[0]


# ---- (a) blocked GPTQ = column-by-column OBS ------------------------------------------------------


@pytest.mark.parametrize("act_order", [False, True], ids=["natural", "act_order"])
@pytest.mark.parametrize("g,block", [(32, 32), (64, 40), (16, 128), (-1, 24)])
def test_blocked_gptq_matches_column_by_column_obs(g, block, act_order):
    """Same codes as the textbook update, groups inside blocks, across blocks (the pending
    errors of the block owed to a group's later columns) and one group per row; a dead input."""
    torch.manual_seed(0)
    n, out_f, bits = 128, 24, 3
    x = correlated(600, n, seed=1)
    x[:, 5] = 0  # a dead input column
    w = torch.randn(out_f, n, dtype=torch.float64)
    h = hessian64(x)
    qw = gptq_quantize(w, h, bits, g, block_size=block, damp=0.01, act_order=act_order)
    gg = n if g == -1 else g
    Q, S, Z = obs_reference(w, h, bits, gg, 0.01, act_order)
    ours = qw.dequantize(torch.float64)
    ref = dequant(Q, S, Z, gg)
    assert ((ours - ref).norm() / ref.norm()).item() <= 1e-5
    assert (qw.q.double() == Q).float().mean() > 0.999
    assert torch.equal(qw.scales.double(), S) and torch.equal(qw.zeros.double(), Z)
    assert (ours[:, 5] == 0).all()  # dead column: weight 0


@pytest.mark.parametrize("act_order", [False, True], ids=["natural", "act_order"])
def test_symmetric_gptq_matches_column_by_column_obs(act_order):
    """The symmetric grid (no zero point: experts' folders) through the same update."""
    n, out_f, bits, g = 128, 24, 4, 32
    h = hessian64(correlated(600, n, seed=2))
    w = torch.randn(out_f, n, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    qw = gptq_quantize(w, h, bits, g, block_size=40, act_order=act_order, symmetric=True)
    Q, S, Z = obs_reference(w, h, bits, g, 0.01, act_order, symmetric=True)
    ref = dequant(Q, S, Z, g)
    assert ((qw.dequantize(torch.float64) - ref).norm() / ref.norm()).item() <= 1e-5
    assert (qw.q.double() == Q).float().mean() > 0.999
    assert torch.equal(qw.scales.double(), S) and (qw.zeros == 2 ** (bits - 1)).all()


def test_float32_gptq_close_to_reference():
    """The stage's float32 path: the same codes but for a handful of rounding ties."""
    n = 64
    x = correlated(400, n, seed=3)
    w = torch.randn(16, n, generator=torch.Generator().manual_seed(4))
    h = Hessian(n)
    h.add(x)
    qw = gptq_quantize(w, h.value(), 4, 32, block_size=16, act_order=True)
    Q, S, Z = obs_reference(w, hessian64(x), 4, 32, 0.01, True)
    assert (qw.q.double() == Q).float().mean() > 0.99


@pytest.mark.parametrize("act_order", [False, True], ids=["natural", "act_order"])
@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
@pytest.mark.parametrize("floor", [20, 80], ids=["floor0.2", "floor0.8"])
def test_mse_scale_search_matches_column_by_column_obs(act_order, symmetric, floor):
    """``scale_search=mse``: each group's grid (static or fixed when reached, across blocks) is
    the written-out search's over the factors 1 .. ``min_range``, and the codes are OBS's with
    those grids."""
    n, out_f, bits, g = 128, 16, 3, 32
    h = hessian64(correlated(600, n, seed=7))
    w = torch.randn(out_f, n, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    w[0, 3] = 6.0  # an outlier weight: its group's best range is shrunk
    qw = gptq_quantize(w, h, bits, g, block_size=48, act_order=act_order, symmetric=symmetric,
                       scale_search="mse", min_range=floor / 100)  # fmt: skip
    Q, S, Z = obs_reference(w, h, bits, g, 0.01, act_order, symmetric, mse=True, floor=floor)
    assert torch.equal(qw.scales.double(), S) and torch.equal(qw.zeros.double(), Z)
    ref = dequant(Q, S, Z, g)
    assert ((qw.dequantize(torch.float64) - ref).norm() / ref.norm()).item() <= 1e-5
    minmax = gptq_quantize(w, h, bits, g, block_size=48, act_order=act_order, symmetric=symmetric)
    assert not torch.equal(minmax.scales, qw.scales)  # the search moved some ranges


@pytest.mark.parametrize("bits", [4, 3])
def test_mse_scale_search_lowers_the_output_error(bits):
    """On full-rank mixed inputs with outlier channels and heavy-tailed weights, the searched
    grids leave at least 10% less output error ``||(W - W_hat) X||`` than min/max grids (on
    nearly low-rank inputs GPTQ's compensation hides the grid, and the two are level)."""
    n = 256
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2048, n, generator=gen) @ (torch.eye(n) + torch.randn(n, n, generator=gen) / 16)
    x[:, :4] *= 20
    w = torch.randn(96, n, generator=gen) * 0.02
    w[torch.rand(w.shape, generator=gen) < 0.002] *= 8
    h = hessian64(x).float()
    err = {}
    for search in ("minmax", "mse"):
        qw = gptq_quantize(w, h, bits, 64, act_order=True, scale_search=search)
        err[search] = (x @ (w - qw.dequantize()).t()).norm() / (x @ w.t()).norm()
    assert err["mse"] < 0.9 * err["minmax"], err


# ---- (b) GPTQ beats RTN where inputs correlate ----------------------------------------------------


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_error_well_below_rtn_on_correlated_inputs(act_order):
    n = 256
    x = correlated(2048, n, seed=5)
    w = torch.randn(64, n, generator=torch.Generator().manual_seed(6)) * 0.05
    h = Hessian(n)
    for chunk in x.split(300):
        h.add(chunk)
    qw = gptq_quantize(w, h.value(), 3, 64, act_order=act_order)
    gptq_err = (x @ (w - qw.dequantize()).t()).norm()
    rtn_err = (x @ (w - fake_quantize(w, 3, 64)).t()).norm()
    assert gptq_err < 0.5 * rtn_err


# ---- (c) act-order's static groups are the saved format's groups ---------------------------------


@pytest.mark.parametrize("bits", [4, 3])
def test_act_order_static_groups_round_trip_the_saved_format(bits):
    """Each run of group_size input columns shares one scale and zero point, computed from the
    original weights in the original order; packing into the layer and unpacking gives back the
    same codes and the same dequantized weight (no g_idx)."""
    n, g = 128, 32
    gen = torch.Generator().manual_seed(7)
    x = correlated(800, n, seed=8) * (0.1 + 5 * torch.rand(n, generator=gen))  # shuffled energy
    w = torch.randn(64, n, generator=gen) * 0.05
    h = Hessian(n)
    h.add(x)
    H = h.value()
    perm = torch.argsort(H.diagonal(), descending=True)
    assert not torch.equal(perm, torch.arange(n))  # act-order does reorder
    qw = gptq_quantize(w, H, bits, g, act_order=True)
    s, z = grid(w.double().reshape(64, n // g, g), bits)
    assert torch.equal(qw.scales.double(), s) and torch.equal(qw.zeros.double(), z)
    w_hat = qw.dequantize()
    codes = w_hat.reshape(64, n // g, g) / qw.scales.float().unsqueeze(-1) + qw.zeros.unsqueeze(-1)
    assert torch.allclose(codes, codes.round(), atol=1e-3)
    assert codes.round().min() >= 0 and codes.round().max() <= 2**bits - 1
    layer = QuantLinear.from_quantized(qw)
    q_t, z_t = layer.codes()
    assert torch.equal(q_t.t(), qw.q) and torch.equal(z_t.t(), qw.zeros)
    assert torch.equal(layer.dequantize(), w_hat)
    y = torch.randn(3, n, generator=gen)
    assert torch.allclose(layer(y), y @ w_hat.t(), rtol=1e-4, atol=1e-5)


# ---- (d) the streamed Hessian ----------------------------------------------------------------------


def test_streamed_hessian_equals_one_shot():
    x = correlated(3 * 97, 96, seed=9).reshape(3, 97, 96)  # [samples, seq, in]
    h = Hessian(96)
    for chunk in (x[:1], x[1:2, :50], x[1:2, 50:], x[2:]):  # uneven chunks
        h.add(chunk)
    assert h.n == 3 * 97 and h.sum.dtype == torch.float32
    ref = hessian64(x)
    assert ((h.value().double() - ref).norm() / ref.norm()).item() < 1e-6


# ---- (e) the stage on tiny models -------------------------------------------------------------------


def stage_cfg(**over):
    c = dict(bits=4, group_size="auto", damp=0.01, block_size=128, act_order=False,
             true_sequential=True, batch=2)  # fmt: skip
    c.update(over)
    return OmegaConf.create({"gptq": c})


def calib(n=4, seq=48):
    return torch.cat([tokens(seq, 100 + i) for i in range(n)])


def run_stage(model, **over):
    ctx = SimpleNamespace(cfg=stage_cfg(**over), calibration=calib, record={})
    return gptq(model, ctx), ctx


@pytest.mark.parametrize(
    "family,over",
    [
        ("llama", {}),
        ("qwen2", {"act_order": True}),  # q/k/v biases, a windowed layer
        ("qwen3", {"true_sequential": False}),  # q/k norms
        ("gemma3_text", {"bits": 3, "act_order": True}),  # (1+w) norms, local/global layers
    ],
)
def test_stage_folder_loads_and_matches_the_in_memory_model(family, over, tmp_path, tokenizer):
    """Every decoder linear becomes a QuantLinear; the saved folder (float32 outside the
    quantized layers) run by our decoder gives the in-memory quantized model's logits."""
    model, ctx = run_stage(family_model(family), **over)
    adapter = get_adapter(model.config)
    linears = adapter.all_linears(model)
    assert linears and all(isinstance(m, QuantLinear) for m in linears.values())
    assert ctx.record["bits"] == over.get("bits", 4) and ctx.record["group_size"] == 64
    save_checkpoint(model, tokenizer, tmp_path / "run", ctx.quantization_config, torch.float32)
    ids = tokens(96)
    assert rel_err(decoder_logits(tmp_path / "run", ids), hf_logits(model, ids)) < 1e-4


def test_true_sequential_hessians_see_the_quantized_inputs(monkeypatch):
    """With true-sequential on, o_proj's and down_proj's Hessians are those of the inputs the
    *quantized* layer gives them; off, q's Hessian is the same and o's is the float layer's."""
    real = gptq_mod.gptq_quantize

    def hessians(true_sequential):
        model = family_model("llama")
        adapter = get_adapter(model.config)
        x, per_layer = capture_inputs(model, adapter, calib(), 2)
        layer = adapter.decoder_layers(model)[0]
        order = []
        monkeypatch.setattr(
            gptq_mod,
            "gptq_quantize",
            lambda w, h, **kw: order.append(h.clone()) or real(w, h, **kw),
        )
        gptq_mod.gptq_layer(layer, adapter, x, per_layer[0], dict(bits=3, group_size=32), 2,
                            true_sequential)  # fmt: skip
        return layer, x, per_layer[0], order  # q k v o gate up down

    layer, x, kw, on = hessians(True)
    feats = {}
    hooks = [
        layer.get_submodule(p).register_forward_hook(
            lambda _m, a, _o, p=p: feats.setdefault(p, []).append(a[0])
        )
        for p in ("self_attn.o_proj", "mlp.down_proj")
    ]
    with torch.no_grad():
        for c in x.split(2):
            layer(c, **kw)
    for hk in hooks:
        hk.remove()
    for i, p in ((3, "self_attn.o_proj"), (6, "mlp.down_proj")):
        ref = hessian64(torch.cat(feats[p]))
        assert ((on[i].double() - ref).norm() / ref.norm()).item() < 1e-5, p
    _, _, _, off = hessians(False)
    assert torch.equal(on[0], off[0])  # q: the layer's own input either way
    assert ((on[3] - off[3]).norm() / off[3].norm()).item() > 1e-4


def test_gptq_stage_closer_to_float_than_rtn():
    """On a tiny Llama calibrated on the text it is then scored on, GPTQ INT3's logits are
    closer to the float model's than RTN's."""

    ids = calib(4, 48)
    with torch.no_grad():
        ref = family_model("llama")(ids, use_cache=False).logits
    model, _ = run_stage(family_model("llama"), bits=3)
    rtn = pack_model(family_model("llama"), 3, 64)
    with torch.no_grad():
        g_err = rel_err(model(ids, use_cache=False).logits, ref)
        r_err = rel_err(rtn(ids, use_cache=False).logits, ref)
    assert g_err < r_err


def test_sequential_steps_from_the_adapters_roles():
    """Llama: q/k/v, o, gate/up, down; MLA's converted layers: q/k_rope/kv_a, k_b/v_b, o, ...;
    a role the order does not place is refused."""
    model = family_model("llama")
    adapter = get_adapter(model.config)
    steps = sequential_steps(adapter, adapter.decoder_layers(model)[0])
    assert [[r for r, _ in s] for s in steps] == [["q", "k", "v"], ["o"], ["gate", "up"], ["down"]]

    layer = nn.Module()
    for _role, path in MLA.linears:
        parent, _, child = path.rpartition(".")
        if not hasattr(layer, parent):
            layer.add_module(parent, nn.Module())
        getattr(layer, parent).add_module(child, nn.Linear(8, 8))
    steps = sequential_steps(MLA, layer)
    assert [[r for r, _ in s] for s in steps] == [
        ["q", "k_rope", "kv_a"], ["k_b", "v_b"], ["o"], ["gate", "up"], ["down"]
    ]  # fmt: skip
    odd = type(MLA)(family="odd", linears=(("q", "self_attn.q_proj"), ("x", "mlp.gate_proj")))
    with pytest.raises(CompressError, match=r"\['x'\].*SEQUENTIAL"):
        sequential_steps(odd, layer)


# ---- (f) refusals and the AWQ -> GPTQ recipes -----------------------------------------------------


@pytest.mark.parametrize(
    "override,match",
    [
        ("gptq.bits=9", r"gptq.bits=9.*integer from 2 to 8"),
        ("gptq.bits=1", r"gptq.bits=1.*integer from 2 to 8"),
        ("gptq.damp=0", r"gptq.damp=0.*strictly between 0 and 1"),
        ("gptq.damp=1.0", r"gptq.damp=1.0.*strictly between 0 and 1"),
        ("gptq.damp=-0.1", r"gptq.damp=-0.1.*strictly between 0 and 1"),
        ("gptq.block_size=0", r"gptq.block_size=0.*integer >= 1"),
        ("gptq.batch=0", r"gptq.batch=0.*integer >= 1"),
        ("gptq.scale_search=l1", r"gptq.scale_search='l1'.*minmax, mse"),
        ("gptq.min_range=0", r"gptq.min_range=0.*between 0.01 and 1"),
        ("gptq.min_range=1.5", r"gptq.min_range=1.5.*between 0.01 and 1"),
        ("gptq.group_size=48", r"gptq.group_size=48.*power of two"),
        ("gptq.group_size=256", r"group size 256 does not divide.*in_features=64"),
    ],
)
def test_check_refuses_bad_settings_before_loading(override, match, tmp_path, monkeypatch):
    """Each bad gptq.* setting: one paragraph naming the key and the fix, from the stage's
    check with config.json's shapes and from validate (which loads no weights)."""
    folder = tmp_path / "model"
    family_model("llama").config.save_pretrained(folder)
    cfg = compose("gptq_int4", [f"model.path={folder}", *TINY_OVERRIDES, override])
    with pytest.raises(CompressError, match=match) as e:
        get_stage("gptq").check(cfg, family_config("llama"))
    assert "\n" not in str(e.value)
    monkeypatch.setattr(pipeline, "load_model", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(CompressError, match=match):
        validate(cfg)


def test_awq_gptq_recipes_compose_and_double_quantization_stays_refused():
    for name, bits in (("awq_gptq_int4", 4), ("awq_gptq_int3", 3)):
        cfg = compose(name)
        check_stage_list(cfg)
        assert list(cfg.stages) == ["awq", "gptq"] and cfg.awq.quantize is False
        assert cfg.awq.bits == bits == cfg.gptq.bits  # the search assumes GPTQ's grid
        get_stage("awq").check(cfg)
        get_stage("gptq").check(cfg)
    refusals = [
        ("awq_gptq_int4", ["awq.quantize=true"], r"awq replaces.*set awq.quantize=false"),
        ("awq_gptq_int4", ["stages=[awq]"], r"none follows awq.*\[awq,gptq\]"),
        ("awq_gptq_int4", ["stages=[gptq,awq]"], r"none follows awq"),
        ("awq_gptq_int4", ["stages=[gptq,gptq]"], r"gptq is listed twice"),
        ("rtn_int4", ["stages=[rtn,rtn]"], r"rtn is listed twice"),
        ("awq_int4", ["awq.quantize=maybe"], r"awq.quantize='maybe'.*true.*false"),
    ]
    for recipe, over, match in refusals:
        cfg = compose(recipe, over)
        with pytest.raises(CompressError, match=match):
            check_stage_list(cfg)
            get_stage("awq").check(cfg)


def test_awq_without_quantize_folds_then_gptq_quantizes(tmp_path, tokenizer):
    """awq.quantize=false, clip off: the model computes what it did (scales folded, float
    linears, no quantization_config); gptq then quantizes it into a loadable folder."""
    cfg = compose("awq_gptq_int4", ["awq.n_grid=4", "awq.search_samples=2", "awq.batch=2",
                                    "awq.clip=false", "gptq.batch=2"])  # fmt: skip
    ids = tokens(64, 9)
    reference = hf_logits(family_model("qwen3"), ids)
    ctx = SimpleNamespace(cfg=cfg, calibration=calib, record={}, quantization_config=None)
    model = awq(family_model("qwen3"), ctx)
    assert ctx.quantization_config is None and "awq_alpha" in ctx.record
    assert all(type(m) is nn.Linear for m in get_adapter(model.config).all_linears(model).values())
    assert rel_err(hf_logits(model, ids), reference) < 1e-5
    model = gptq(model, ctx)
    assert ctx.quantization_config["quant_method"] == "compressed-tensors"
    save_checkpoint(model, tokenizer, tmp_path / "run", ctx.quantization_config, torch.float32)
    assert rel_err(decoder_logits(tmp_path / "run", ids), hf_logits(model, ids)) < 1e-4


@pytest.mark.parametrize("recipe", ["gptq_int4", "awq_gptq_int3"])
def test_recipe_runs_end_to_end(recipe, tiny_dir, tmp_path):
    """The recipe through the pipeline (disk-backed layers, evaluation): the folder loads in
    transformers with our layers and our decoder computes the same logits."""

    over = [f"model.path={tiny_dir}", *TINY_OVERRIDES, "gptq.batch=2", "decode.enabled=false"]
    if recipe.startswith("awq"):
        over += ["awq.batch=2", "awq.n_grid=4", "awq.search_samples=2"]
    report = run(compose(recipe, over), tmp_path / "run")
    assert report["bits"] == (4 if recipe.endswith("4") else 3) and report["ppl"] < 1e6
    hf, _ = load_run(tmp_path / "run")  # transformers' model with the saved quantized layers
    assert all(isinstance(m, QuantLinear) for m in get_adapter(hf.config).all_linears(hf).values())
    ids = tokens(96)
    assert rel_err(decoder_logits(tmp_path / "run", ids), hf_logits(hf, ids)) < 1e-3


def test_stage_quantizes_every_linear_of_mla_layers():
    """MLA's converted layers: q, k_rope, kv_a, then k_b and v_b on the latent, then o, ...; the
    quantized model stays as close to the float one as RTN's at 4 bits."""

    def source():
        return convert_mla(make_tiny_model(), d_kv=32, rope_pairs=4, rope_select="high")

    ids = calib(2, 40)
    with torch.no_grad():
        reference = source()(ids).logits
    model, ctx = run_stage(source(), group_size=64)
    linears = get_adapter(model.config).all_linears(model)
    assert all(isinstance(m, QuantLinear) for m in linears.values())
    roles = {name.rpartition(".")[2] for name in linears}
    assert {"k_rope_proj", "kv_a_proj", "k_b_proj", "v_b_proj"} <= roles
    rtn = pack_model(source(), 4, 64)
    with torch.no_grad():
        err = rel_err(model(ids).logits, reference)
        assert err < 1.5 * rel_err(rtn(ids).logits, reference)


def test_stage_refuses_cross_layer_attention():
    """CLA's later layers read K/V computed by an earlier layer in the same forward: refused
    (from the config, before any weight) rather than calibrated wrongly."""

    model = convert_cla(make_tiny_model(), 2, "first")
    with pytest.raises(CompressError, match="cross-layer attention.*rtn"):
        get_stage("gptq").check(stage_cfg(), model.config)
    with pytest.raises(CompressError, match="cross-layer attention"):
        run_stage(model)


def test_gpu_check_script_runs_on_the_cpu():
    """``eval/bench/gpu_check.py`` (the GPU's checks of GPTQ and the rotation) at CPU sizes: the
    device's codes equal the CPU's (here the same device), the stage's and rotation's logits
    agree."""
    out = run_bench("gpu_check", "--device", "cpu", "--small").stdout
    rows = [line for line in out.splitlines() if line.startswith("| 256 x 128")]
    assert len(rows) == 3 and all(r.split("|")[5].strip() == "1.0000" for r in rows)
    values = dict(line.split(": ") for line in out.splitlines() if ": " in line)
    assert float(values["stage_logits_rel"]) < 1e-5 and float(values["rotation_logits_rel"]) < 1e-5


def test_gptq_vs_awq_script_runs_small(tiny_dir, tmp_path):
    """``eval/bench/gptq_vs_awq.py`` at tiny sizes: both recipes calibrate, both folders decode,
    and it prints the two ratios the issue's bars read."""
    out = run_bench(
        "gptq_vs_awq", "--model", tiny_dir, "--small", "--rounds", "1", "--out", tmp_path
    ).stdout
    rows = [
        line for line in out.splitlines() if line.startswith("| awq_int4") or "| gptq_int4" in line
    ]
    assert len(rows) == 2 and all(float(r.split("|")[4]) > 0 for r in rows)
    assert (
        "GPTQ / AWQ calibration time" in out and (tmp_path / "gptq_int4" / "report.json").is_file()
    )

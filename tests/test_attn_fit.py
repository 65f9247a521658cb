"""Head alignment before GQA pooling and layer-local fitting of converted attention, against
float64 math on tiny random Llamas: the alignment changes nothing the model computes, the pooled
key keeps the group's mean square, and fitting lowers each layer's attention-output error on the
source's own inputs, measured here by hooks independent of the fitting's own figures."""

import copy

import pytest
import torch

from compress.errors import CompressError
from compress.methods.attn.cla import convert_cla
from compress.methods.attn.fit import fit_attention, groups_of
from compress.methods.attn.gqa import (
    align_heads,
    aligned_pool_kv,
    input_moments,
    mean_pool_kv,
    similarity_groups,
)
from compress.methods.attn.mla import convert_mla
from tests.conftest import make_tiny_model


def tokens(n=4, t=48, seed=0):
    return torch.randint(0, 49152, (n, t), generator=torch.Generator().manual_seed(seed))


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@torch.no_grad()
def attention_io(model, ids):
    """Each layer's attention ``(input, output)`` in a forward of ``model`` on ``ids``."""
    seen = {}

    def hook(i):
        def grab(_m, args, kwargs, out):
            seen[i] = (kwargs.get("hidden_states", args[0] if args else None), out[0])

        return grab

    layers = model.model.layers
    hs = [
        ly.self_attn.register_forward_hook(hook(i), with_kwargs=True) for i, ly in enumerate(layers)
    ]
    try:
        model(ids)
    finally:
        for h in hs:
            h.remove()
    return [seen[i] for i in range(len(layers))]


@torch.no_grad()
def source_input_errors(source, model, ids):
    """Per layer: ``||attn'_l(x_l) - attn_l(x_l)|| / ||attn_l(x_l)||`` on the source's own
    attention inputs ``x_l``, run through ``model``'s layer l alone (CLA groups in order)."""
    io = attention_io(source, ids)
    pos = torch.arange(ids.shape[1])[None]
    cos_sin = model.model.rotary_emb(io[0][0], pos)
    errs = []
    for i, layer in enumerate(model.model.layers):
        out = layer.self_attn(io[i][0], position_embeddings=cos_sin, attention_mask=None)[0]
        errs.append(rel(out, io[i][1]))
    return errs


@pytest.mark.parametrize(("kv", "groups", "bias"), [(2, 1, False), (4, 2, False), (4, 1, True)])
def test_aligned_heads_compute_the_source_in_float64(kv, groups, bias):
    source = make_tiny_model(num_hidden_layers=2, num_key_value_heads=kv, attention_bias=bias)
    source = source.double()
    model = copy.deepcopy(source)
    ids = tokens()
    scales = align_heads(model, groups, input_moments(model, ids, bias))
    moved = [
        n
        for (n, p), q in zip(source.named_parameters(), model.parameters())
        if not torch.equal(p, q)
    ]
    assert any("k_proj" in n for n in moved) and any("o_proj" in n for n in moved)
    x = tokens(2, 32, seed=5)
    with torch.no_grad():
        assert rel(model(x).logits, source(x).logits) < 1e-12
        for (_, a), (_, b) in zip(attention_io(model, x), attention_io(source, x), strict=True):
            assert rel(a, b) < 1e-12
    assert all(s > 1 for s in scales)  # near-orthogonal random heads: the mean key shrinks


def test_pooled_key_keeps_the_groups_mean_square():
    """E||k_pooled||^2 = mean_g E||k_g||^2 on the calibration text, per layer (measured on the
    projected activations in float64, not from the moments the code used)."""
    source = make_tiny_model(num_hidden_layers=2, num_key_value_heads=2).double()
    ids = tokens()
    model = aligned_pool_kv(copy.deepcopy(source), 1, ids)
    assert model.config.num_key_value_heads == 1
    for (x, _), src, ours in zip(
        attention_io(source, ids), source.model.layers, model.model.layers, strict=True
    ):
        x = x.reshape(-1, x.shape[-1])
        heads = src.self_attn.k_proj(x).view(x.shape[0], 2, -1)
        want = heads.pow(2).sum(-1).mean(0).mean()
        got = ours.self_attn.k_proj(x).pow(2).sum(-1).mean()
        assert abs(got / want - 1) < 1e-9


def test_alignment_beats_mean_pooling_on_the_attention_outputs():
    source = make_tiny_model(num_hidden_layers=2, num_key_value_heads=4)
    ids = tokens()
    mean = source_input_errors(source, mean_pool_kv(copy.deepcopy(source), 1), ids)
    aligned = source_input_errors(source, aligned_pool_kv(copy.deepcopy(source), 1, ids), ids)
    assert all(a < m for a, m in zip(aligned, mean, strict=True)), (aligned, mean)


def test_similar_heads_are_grouped():
    """Heads 0 and 2 alike (and 1 and 3): groups of two pair them, not the neighbours."""
    sim = torch.eye(4, dtype=torch.float64)
    sim[0, 2] = sim[2, 0] = sim[1, 3] = sim[3, 1] = 0.9
    sim[0, 1] = sim[1, 0] = 0.2
    assert similarity_groups(sim, 2) == [[0, 2], [1, 3]]
    assert similarity_groups(sim, 4) == [[0, 2, 1, 3]]


@pytest.mark.parametrize("kind", ["gqa", "cla", "mla"])
def test_fitting_lowers_each_layers_attention_error(kind):
    """On the batch the fitting holds out (the last ``batch`` sequences), measured here by hooks:
    lower after, and the report's figures are those errors. A narrow model (hidden 64), so that
    4,096 tokens constrain its attention's parameters."""
    source = make_tiny_model(num_hidden_layers=2, hidden_size=64, intermediate_size=128)
    ids = tokens(64, 64)
    convert = {
        "gqa": lambda m: mean_pool_kv(m, 1),
        "cla": lambda m: convert_cla(m, 2, "lstsq", ids),
        "mla": lambda m: convert_mla(m, 4, 2, "2norm", ids, "activations"),
    }[kind]
    model = convert(copy.deepcopy(source))
    held_out = ids[-8:]
    before = source_input_errors(source, model, held_out)
    report = fit_attention(source, model, ids, steps=60, lr=3e-3, batch=8)  # the recipe's lr
    after = source_input_errors(source, model, held_out)
    assert report["groups"] == groups_of(model.config)
    for key, errs in (("before", before), ("after", after)):
        for group, figure in zip(report["groups"], report[key], strict=True):
            mean_square = sum(errs[layer] ** 2 for layer in group) / len(group)
            assert figure == pytest.approx(mean_square**0.5, rel=1e-3, abs=1e-4)
    assert all(a <= b for a, b in zip(report["after"], report["before"], strict=True))
    assert all(a < b for a, b in zip(after, before, strict=True)), (before, after)
    assert all(p.requires_grad for p in model.parameters())  # as given: distillation trains next


def test_fitting_the_source_itself_changes_nothing():
    source = make_tiny_model(num_hidden_layers=2)
    model = copy.deepcopy(source)
    report = fit_attention(source, model, tokens(4, 32), steps=5, batch=2)
    assert max(report["before"]) < 1e-10
    assert all(torch.equal(p, q) for p, q in zip(source.parameters(), model.parameters()))


def test_fit_refuses_bad_settings_and_other_depths():
    source = make_tiny_model(num_hidden_layers=2)
    with pytest.raises(CompressError, match="fit.steps"):
        fit_attention(source, copy.deepcopy(source), tokens(), steps=-1)
    with pytest.raises(CompressError, match="layers"):
        fit_attention(source, make_tiny_model(num_hidden_layers=3), tokens(), steps=1)
    with pytest.raises(CompressError, match="calib.samples"):
        fit_attention(source, copy.deepcopy(source), tokens(1), steps=1, batch=4)

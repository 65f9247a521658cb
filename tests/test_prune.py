"""Minitron importance and pruning on tiny random Llamas, against independent computations."""

import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from compress.errors import CompressError
from compress.methods.prune.importance import (
    activation_importance,
    cached_importance,
    layer_ppl_drop,
)
from compress.methods.prune.prune import (
    check_sizes,
    layout_of,
    param_count,
    param_total,
    prune_model,
    resolve_target,
    sizes_of,
    solve_budget,
)
from tests.conftest import ROOT, make_tiny_model

GQA = dict(
    hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=16
)  # 3 query heads per group


def tokens(n=5, seqlen=24, seed=0, vocab=49152):
    return torch.randint(0, vocab, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def logits(model, x):
    with torch.no_grad():
        return model(x, use_cache=False).logits


# ---- an independent float64 Llama forward, recording what importance.py scores ----------------


def _rms(x, w, eps):
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x, pos, theta):
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = pos[:, None].double() * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def manual_trace(model, ids):
    """Per layer: head outputs [S, H, hd], MLP activations [S, I], norm outputs, block in/out."""
    c = model.config
    sd = {k: v.double() for k, v in model.state_dict().items()}
    H, KV, hd, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
    theta = c.rope_parameters["rope_theta"]
    S = ids.numel()
    pos, mask = torch.arange(S), torch.ones(S, S, dtype=torch.bool).tril()
    x = sd["model.embed_tokens.weight"][ids]
    trace = []
    for l in range(c.num_hidden_layers):
        p = lambda n: sd[f"model.layers.{l}.{n}"]  # noqa: E731
        n1 = _rms(x, p("input_layernorm.weight"), eps)
        q = _rope((n1 @ p("self_attn.q_proj.weight").T).view(S, H, hd).transpose(0, 1), pos, theta)
        k = _rope((n1 @ p("self_attn.k_proj.weight").T).view(S, KV, hd).transpose(0, 1), pos, theta)
        v = (n1 @ p("self_attn.v_proj.weight").T).view(S, KV, hd).transpose(0, 1)
        k, v = k.repeat_interleave(H // KV, 0), v.repeat_interleave(H // KV, 0)
        att = (q @ k.transpose(1, 2) / math.sqrt(hd)).masked_fill(~mask, float("-inf")).softmax(-1)
        heads = (att @ v).transpose(0, 1)  # [S, H, hd]
        h = x + heads.reshape(S, H * hd) @ p("self_attn.o_proj.weight").T
        n2 = _rms(h, p("post_attention_layernorm.weight"), eps)
        act = F.silu(n2 @ p("mlp.gate_proj.weight").T) * (n2 @ p("mlp.up_proj.weight").T)
        y = h + act @ p("mlp.down_proj.weight").T
        trace.append(dict(heads=heads, act=act, n1=n1, n2=n2, x_in=x, x_out=y))
        x = y
    return trace


def manual_importance(model, x):
    """The Minitron aggregation, sample by sample: sqrt(sum_b (mean_s a)^2), BI = 1 - mean cos."""
    traces = [manual_trace(model, ids) for ids in x]
    L = model.config.num_hidden_layers
    agg = lambda per_sample: torch.stack(per_sample).pow(2).sum(0).sqrt()  # noqa: E731
    out = {"heads": [], "neurons": [], "channels": 0, "block": []}
    for l in range(L):
        out["heads"].append(agg([t[l]["heads"].norm(dim=-1).mean(0) for t in traces]))
        out["neurons"].append(agg([t[l]["act"].abs().mean(0) for t in traces]))
        for key in ("n1", "n2"):
            out["channels"] = out["channels"] + agg([t[l][key].abs().mean(0) for t in traces])
        cos = torch.cat([F.cosine_similarity(t[l]["x_in"], t[l]["x_out"], dim=-1) for t in traces])
        out["block"].append(1 - cos.mean())
    return {k: torch.stack(v) if isinstance(v, list) else v for k, v in out.items()}


def test_importance_matches_float64_reference():
    model = make_tiny_model(**GQA)
    x = tokens()
    got = activation_importance(model, x, batch_size=2, progress=False)
    ref = manual_importance(model, x)
    for key in ("heads", "neurons", "channels", "block"):
        torch.testing.assert_close(got[key].double(), ref[key], rtol=2e-5, atol=1e-6, msg=key)
    H, KV = 6, 2
    groups = ref["heads"].view(2, KV, H // KV).norm(dim=-1)  # GQA: L2 over a group's query heads
    torch.testing.assert_close(got["groups"].double(), groups, rtol=2e-5, atol=1e-6)


def test_importance_streaming_equals_one_batch():
    model = make_tiny_model(**GQA)
    x = tokens(n=6)
    one = activation_importance(model, x, batch_size=6, progress=False)
    streamed = activation_importance(model, x, batch_size=1, progress=False)
    for key in one:
        torch.testing.assert_close(streamed[key], one[key], rtol=1e-5, atol=1e-7, msg=key)


MEMORY_SCRIPT = r"""
import resource, sys, torch
from transformers import LlamaConfig, AutoModelForCausalLM
from compress.methods.prune.importance import activation_importance
cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=2048, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
model = AutoModelForCausalLM.from_config(cfg).eval()
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
x = torch.randint(0, 512, (48, 128))
activation_importance(model, x[:4], batch_size=2, progress=False)
small = peak()
activation_importance(model, x, batch_size=2, progress=False)
print(small, peak())
"""


def test_importance_peak_memory_does_not_grow_with_samples():
    """48 samples instead of 4: holding the MLP activations of all samples would take
    48 x 128 x 2048 x 4 B = 50 MB per layer; streaming keeps the peak where 4 samples put it."""
    res = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert res.returncode == 0, res.stderr[-2000:]
    small, large = map(int, res.stdout.split())
    assert large - small < 20e6, (small, large)


def test_importance_cache_skips_calibration(tmp_path, monkeypatch):
    import compress.methods.prune.importance as imp

    model = make_tiny_model()
    settings = {"calib": "x", "samples": 3, "seqlen": 16, "seed": 0}
    first, path = cached_importance(model, lambda: tokens(3, 16), settings, tmp_path, batch_size=2)
    assert path.is_file()
    monkeypatch.setattr(imp, "activation_importance", lambda *a, **k: pytest.fail("recomputed"))
    again, path2 = cached_importance(model, lambda: pytest.fail("tokenized"), settings, tmp_path)
    assert path2 == path and all(torch.equal(first[k], again[k]) for k in first)
    assert imp.scores_key("w", settings) != imp.scores_key("w", {**settings, "samples": 4})


def test_layer_ppl_drop_matches_zeroed_layer():
    model = make_tiny_model(num_hidden_layers=3)
    x = tokens(2, 16)
    drops = layer_ppl_drop(model, x, progress=False)

    def ppl(m):
        lg = logits(m, x)[:, :-1]
        return math.exp(F.cross_entropy(lg.flatten(0, 1), x[:, 1:].flatten()).item())

    base = ppl(model)
    for l in range(3):
        m = make_tiny_model(num_hidden_layers=3)
        with torch.no_grad():  # a block whose residual branches write zero is the identity
            m.model.layers[l].self_attn.o_proj.weight.zero_()
            m.model.layers[l].mlp.down_proj.weight.zero_()
        assert abs(drops[l].item() - (ppl(m) - base)) < 1e-3 * ppl(m)


# ---- pruning equals the original with the pruned units zeroed -------------------------------------


def random_scores(model, seed=1):
    """Importance-shaped random scores: the test picks the survivors independently with topk."""
    c = model.config
    g = torch.Generator().manual_seed(seed)
    L, H, KV = c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads
    heads = torch.rand(L, H, generator=g)
    return {
        "heads": heads,
        "groups": torch.rand(L, KV, generator=g),
        "neurons": torch.rand(L, c.intermediate_size, generator=g),
        "channels": torch.rand(c.hidden_size, generator=g),
        "block": torch.rand(L, generator=g),
    }


def top(score, k):
    return set(torch.topk(score, k).indices.tolist())


def test_pruned_neurons_equal_zeroed_neurons():
    model = make_tiny_model(**GQA)
    scores = random_scores(model)
    pruned = prune_model(model, scores, {"intermediate_size": 100})
    ref = make_tiny_model(**GQA)
    with torch.no_grad():
        for l, layer in enumerate(ref.model.layers):
            drop = sorted(set(range(256)) - top(scores["neurons"][l], 100))
            layer.mlp.down_proj.weight[:, drop] = 0
    x = tokens(2, 16)
    torch.testing.assert_close(logits(pruned, x), logits(ref, x), rtol=1e-5, atol=1e-5)
    assert pruned.config.intermediate_size == 100 and pruned.model.layers[
        0
    ].mlp.up_proj.weight.shape == (100, 96)


@pytest.mark.parametrize("heads,kv", [(4, 2), (3, 1), (2, 2)])
def test_pruned_heads_equal_zeroed_heads(heads, kv):
    """KV groups keep the top F_group; within them, the top F_head query heads survive."""
    model = make_tiny_model(**GQA)
    scores = random_scores(model)
    pruned = prune_model(model, scores, {"num_attention_heads": heads, "num_key_value_heads": kv})
    ref = make_tiny_model(**GQA)
    hd = 16
    with torch.no_grad():
        for l, layer in enumerate(ref.model.layers):
            keep = set()
            for g in top(scores["groups"][l], kv):
                keep |= {
                    g * 3 + h for h in top(scores["heads"][l][g * 3 : (g + 1) * 3], heads // kv)
                }
            for h in set(range(6)) - keep:
                layer.self_attn.o_proj.weight[:, h * hd : (h + 1) * hd] = 0
    x = tokens(2, 16)
    torch.testing.assert_close(logits(pruned, x), logits(ref, x), rtol=1e-5, atol=1e-5)
    c = pruned.config
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (heads, kv, hd)


def test_pruned_layers_equal_identity_layers():
    model = make_tiny_model(num_hidden_layers=4)
    scores = random_scores(model)
    pruned = prune_model(model, scores, {"num_hidden_layers": 2})
    ref = make_tiny_model(num_hidden_layers=4)
    with torch.no_grad():
        for l in set(range(4)) - top(scores["block"], 2):
            ref.model.layers[l].self_attn.o_proj.weight.zero_()
            ref.model.layers[l].mlp.down_proj.weight.zero_()
    x = tokens(2, 16)
    torch.testing.assert_close(logits(pruned, x), logits(ref, x), rtol=1e-5, atol=1e-5)
    assert [m.self_attn.layer_idx for m in pruned.model.layers] == [0, 1]  # renumbered


def test_pruned_hidden_channels_equal_zeroed_channels():
    """With rms_norm_eps = 0, zeroing channels (embedding columns, o/down rows) and scaling every
    norm weight by sqrt(D'/D) gives the same function as slicing them away."""
    model = make_tiny_model(rms_norm_eps=0.0)
    scores = random_scores(model)
    pruned = prune_model(model, scores, {"hidden_size": 80})
    assert pruned.lm_head.weight is pruned.model.embed_tokens.weight  # still tied
    ref = make_tiny_model(rms_norm_eps=0.0)
    drop = sorted(set(range(128)) - top(scores["channels"], 80))
    scale = math.sqrt(80 / 128)
    with torch.no_grad():
        ref.model.embed_tokens.weight[:, drop] = 0
        ref.model.norm.weight.mul_(scale)
        for layer in ref.model.layers:
            layer.self_attn.o_proj.weight[drop] = 0
            layer.mlp.down_proj.weight[drop] = 0
            layer.input_layernorm.weight.mul_(scale)
            layer.post_attention_layernorm.weight.mul_(scale)
    x = tokens(2, 16)
    torch.testing.assert_close(logits(pruned, x), logits(ref, x), rtol=1e-4, atol=1e-5)


def test_saved_pruned_folder_loads_in_transformers(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM

    from compress.io.checkpoint import load_run, save_checkpoint

    model = make_tiny_model(**GQA)
    pruned = prune_model(
        model,
        random_scores(model),
        {
            "hidden_size": 64,
            "intermediate_size": 192,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": 1,
        },
    )
    save_checkpoint(pruned, tokenizer, tmp_path, None)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["hidden_size"], config["head_dim"], config["num_hidden_layers"]) == (64, 16, 1)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    x = tokens(2, 16)
    torch.testing.assert_close(logits(hf, x), logits(pruned, x), rtol=0, atol=0)
    ours, _ = load_run(tmp_path)
    torch.testing.assert_close(logits(ours, x), logits(pruned, x), rtol=0, atol=0)


def test_untied_lm_head_is_sliced():
    model = make_tiny_model(tie_word_embeddings=False)
    pruned = prune_model(model, random_scores(model), {"hidden_size": 64})
    assert (
        pruned.lm_head.weight.shape == (49152, 64)
        and pruned.lm_head.weight is not pruned.model.embed_tokens.weight
    )
    assert param_total(pruned) == param_count(layout_of(pruned), sizes_of(pruned.config))


# ---- the budget solver and bad input --------------------------------------------------------------

SMOL = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    num_hidden_layers=30,
)


def test_param_count_formula_matches_models():
    model = make_tiny_model(**GQA)
    lay = layout_of(model)
    assert param_count(lay, sizes_of(model.config)) == param_total(model)
    for sizes in (
        {"hidden_size": 60, "intermediate_size": 96},
        {"num_attention_heads": 2, "num_key_value_heads": 1},
    ):
        pruned = prune_model(model, random_scores(model), sizes)
        assert param_total(pruned) == param_count(lay, sizes_of(pruned.config))


@pytest.mark.parametrize("target", [0.9, 0.763, 0.7, 0.5, 101e6])
@pytest.mark.parametrize("step", [8, 64])
def test_budget_solver_hits_target(target, step):
    from compress.methods.prune.prune import Layout

    lay = Layout(vocab=49152, head_dim=64, tied=True, bias=())
    full = param_count(lay, SMOL)
    assert full == 134_515_008  # SmolLM2-135M
    want = resolve_target(target, full)
    s = solve_budget(lay, SMOL, want, {}, ["hidden_size", "intermediate_size"], step)
    got = param_count(lay, s)
    check_sizes(SMOL, s)
    # brute force over the grid: hidden a multiple of lcm(step, 9 heads), intermediate of step
    grid = [
        {**SMOL, "hidden_size": D, "intermediate_size": Inter}
        for D in range(math.lcm(step, 9), 577, math.lcm(step, 9))
        for Inter in range(step, 1537, step)
    ]
    fits = [c for c in grid if param_count(lay, c) <= want]
    window = [c for c in fits if param_count(lay, c) >= 0.97 * want]
    assert got <= want and s in grid
    if not window:  # nothing within 3%: the largest that fits
        assert got == max(param_count(lay, c) for c in fits)
    else:  # the most balanced in the window: none keeps more of both axes
        assert got >= 0.97 * want
        keep = lambda c: min(c["hidden_size"] / 576, c["intermediate_size"] / 1536)  # noqa: E731
        assert keep(s) == max(keep(c) for c in window)


def test_budget_solver_recipe_sizes():
    """minitron_width's target on SmolLM2: hidden 504 (a multiple of 8 and of the 9 heads), MLP 1200."""
    from compress.methods.prune.prune import Layout

    lay = Layout(vocab=49152, head_dim=64, tied=True, bias=())
    depth = param_count(lay, {**SMOL, "num_hidden_layers": 21})
    assert depth == 102_654_144
    target = resolve_target(0.763, param_count(lay, SMOL))
    s = solve_budget(lay, SMOL, target, {}, ["hidden_size", "intermediate_size"], 8)
    assert (s["hidden_size"], s["intermediate_size"]) == (504, 1200)
    assert abs(param_count(lay, s) - depth) < 0.01 * depth


def test_budget_solver_with_heads_stays_valid():
    from compress.methods.prune.prune import Layout

    lay = Layout(vocab=49152, head_dim=64, tied=True, bias=())
    for target in (0.95, 0.8, 0.6):
        s = solve_budget(
            lay,
            SMOL,
            resolve_target(target, param_count(lay, SMOL)),
            {},
            ["hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads"],
            64,
        )
        check_sizes(SMOL, s)
        assert s["num_attention_heads"] // s["num_key_value_heads"] <= 3


def test_error_heads_not_dividing_groups_names_nearest():
    with pytest.raises(
        CompressError,
        match=r"num_attention_heads=8 .*num_key_value_heads=3.*3, 6, 9; nearest: 6 or 9",
    ):
        check_sizes(SMOL, {**SMOL, "num_attention_heads": 8})
    with pytest.raises(
        CompressError, match=r"num_attention_heads=8 .*num_key_value_heads=2.*nearest: 6"
    ):
        check_sizes(SMOL, {**SMOL, "num_attention_heads": 8, "num_key_value_heads": 2})


def test_error_hidden_not_multiple_of_heads():
    """transformers' LlamaConfig refuses it (even with head_dim set), so from_pretrained would."""
    with pytest.raises(
        CompressError,
        match=r"hidden_size=500 is not a multiple of num_attention_heads=9.*"
        r"495 or 504; head counts that divide 500: 1, 2, 4",
    ):
        check_sizes(SMOL, {**SMOL, "hidden_size": 500})
    check_sizes(SMOL, {**SMOL, "hidden_size": 500}, hidden_per_head=False)  # mistral, qwen2
    from compress.methods.prune.prune import hidden_must_divide
    from tests.conftest import tiny_config

    assert hidden_must_divide(tiny_config())
    model = make_tiny_model()
    with pytest.raises(
        CompressError, match="hidden_size=90 is not a multiple of num_attention_heads=4"
    ):
        prune_model(model, random_scores(model), {"hidden_size": 90})


def test_error_size_above_source():
    with pytest.raises(
        CompressError, match=r"hidden_size=700 is out of range.*1\.\.576.*nearest: 576"
    ):
        check_sizes(SMOL, {**SMOL, "hidden_size": 700})
    with pytest.raises(CompressError, match=r"num_hidden_layers=0 .*nearest: 1"):
        check_sizes(SMOL, {**SMOL, "num_hidden_layers": 0})


def test_error_budget_below_smallest_width():
    from compress.methods.prune.prune import Layout

    lay = Layout(vocab=49152, head_dim=64, tied=True, bias=())
    with pytest.raises(
        CompressError,
        match=r"below the smallest model.*hidden_size=72, intermediate_size=8\)\. "
        r"Nearest valid target: 6,912,936",
    ):
        solve_budget(lay, SMOL, 5_000_000, {}, ["hidden_size", "intermediate_size"], 8)
    with pytest.raises(
        CompressError, match=r"multiple of the head count.*hidden_size=576, intermediate_size=64"
    ):
        solve_budget(lay, SMOL, 50_000_000, {}, ["hidden_size", "intermediate_size"], 64)
    with pytest.raises(CompressError, match="must be positive"):
        resolve_target(0, 100)


def test_error_depth_metric_without_scores():
    model = make_tiny_model()
    with pytest.raises(CompressError, match="ppl_samples"):
        prune_model(model, random_scores(model), {"num_hidden_layers": 1}, depth_metric="ppl")

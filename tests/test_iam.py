"""IAM attention mapping: similarity and mapping rule, mapped decoding, bad input, the stage.

References are independent of the decoder: transformers' logits and attention weights, and an
explicit float64 Llama forward written here in which mapped layers take the small model's
weights.
"""

import json
import math

import pytest
import torch
from conftest import TINY_OVERRIDES, compose
from test_decoder import rel_err, save, tiny_hf, tiny_tokenizer

from compress.decoder.kv import new_cache
from compress.decoder.model import load
from compress.errors import CompressError
from compress.methods.iam import map as iam_map
from compress.methods.iam.attention import load_mapped
from compress.methods.iam.decode import IAMModel, load_iam

BIG = {"num_hidden_layers": 4}  # 4 heads, 2 KV heads, head_dim 16
SMALL = {
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(large folder, small folder, large HF, small HF), one tokenizer."""
    root, tok = tmp_path_factory.mktemp("iam"), tiny_tokenizer()
    big, small = tiny_hf(**BIG), tiny_hf(**SMALL)
    return save(big, root / "big", tok), save(small, root / "small", tok), big, small


def ids_of(shape, seed=1):
    return torch.randint(0, 300, shape, generator=torch.Generator().manual_seed(seed))


def hf_attentions(hf, ids) -> list[torch.Tensor]:
    """transformers' attention weights per layer ``[B, H, T, T]`` in float64 (eager attention)."""
    import copy

    m = copy.deepcopy(hf).double()
    m.config._attn_implementation = "eager"
    with torch.no_grad():
        return list(m(ids, output_attentions=True).attentions)


def reference_logits(hf_big, hf_small, mapped: dict, heads: dict, ids) -> torch.Tensor:
    """An explicit float64 Llama forward of ``hf_big``: layer l in ``mapped`` mixes its V with
    transformers' attention weights of ``hf_small``'s layer ``mapped[l]`` (heads ``heads[l]``)."""
    P = hf_attentions(hf_small, ids)
    c, sd = hf_big.config, {k: v.double() for k, v in hf_big.state_dict().items()}
    B, T = ids.shape
    H, G, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim

    def norm(x, w):
        return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + c.rms_norm_eps)

    def lin(x, name):
        return x @ sd[name + ".weight"].T

    inv = 1.0 / c.rope_parameters["rope_theta"] ** (torch.arange(0, D, 2).double() / D)
    ang = torch.arange(T).double()[:, None] * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def rot(x):
        a, b = x.chunk(2, -1)
        return x * cos + torch.cat([-b, a], -1) * sin

    x = sd["model.embed_tokens.weight"][ids]
    for ly in range(c.num_hidden_layers):
        p = f"model.layers.{ly}."
        n = norm(x, sd[p + "input_layernorm.weight"])
        v = lin(n, p + "self_attn.v_proj").view(B, T, G, D).transpose(1, 2)
        v = v.repeat_interleave(H // G, 1)
        if ly in mapped:
            w = P[mapped[ly]][:, heads[ly]]
        else:
            q = rot(lin(n, p + "self_attn.q_proj").view(B, T, H, D).transpose(1, 2))
            k = rot(lin(n, p + "self_attn.k_proj").view(B, T, G, D).transpose(1, 2))
            s = q @ k.repeat_interleave(H // G, 1).transpose(-1, -2) / math.sqrt(D)
            s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
            w = s.softmax(-1)
        h = x + lin((w @ v).transpose(1, 2).reshape(B, T, H * D), p + "self_attn.o_proj")
        n2 = norm(h, sd[p + "post_attention_layernorm.weight"])
        up = torch.nn.functional.silu(lin(n2, p + "mlp.gate_proj")) * lin(n2, p + "mlp.up_proj")
        x = h + lin(up, p + "mlp.down_proj")
    return norm(x, sd["model.norm.weight"]) @ sd["model.embed_tokens.weight"].T


def test_explicit_reference_is_transformers_without_mapping(pair):
    """The float64 reference itself: with nothing mapped it is transformers' model."""
    _, _, big, small = pair
    ids = ids_of((2, 24))
    with torch.no_grad():
        want = big(ids).logits
    assert rel_err(reference_logits(big, small, {}, {}, ids), want) < 1e-5


def test_self_mapping_gives_the_models_own_logits(pair):
    """Every layer of a model mapped onto itself, head h onto head h: its own logits (1e-5)."""
    folder, _, big, _ = pair
    L, H = BIG["num_hidden_layers"], 4
    every = list(range(L))
    large, _ = load_mapped(folder, every)
    small, _ = load(folder)
    iam = IAMModel(large, small, {ly: ly for ly in every}, {ly: list(range(H)) for ly in every})
    ids = ids_of((2, 40))
    with torch.no_grad():
        got = iam(ids, new_cache(iam, "full", 2, 40))
        want = big(ids).logits
    assert rel_err(got, want) < 1e-5


def test_evaluation_reads_the_pair_as_a_model(pair):
    """``Logits`` (what the recipe's evaluation gets): the large model's config and head, so
    ``evaluate`` runs on it and gives transformers' figures for a self-mapped pair; a quantized
    head (``quant.lm_head``) replaces the large model's own."""
    from compress.eval.perplexity import evaluate
    from compress.methods.iam.decode import Logits

    folder, _, big, _ = pair
    every = list(range(BIG["num_hidden_layers"]))
    large, _ = load_mapped(folder, every)
    small, _ = load(folder)
    iam = Logits(
        IAMModel(large, small, {ly: ly for ly in every}, {ly: list(range(4)) for ly in every})
    )
    assert iam.config is large.config and iam.lm_head is large.lm_head
    windows = ids_of((2, 32), seed=4)
    got, want = evaluate(iam, windows, big), evaluate(big, windows)
    assert abs(got["ppl"] - want["ppl"]) / want["ppl"] < 1e-5 and got["kl_vs_source"] < 1e-8
    head = torch.nn.Linear(large.lm_head.in_features, large.lm_head.out_features, bias=False)
    iam.lm_head = head  # as quantize_head puts its QuantLinear in place
    assert large.lm_head is head and iam.lm_head is head
    assert "lm_head" not in dict(iam.named_children())


def test_self_map_file_maps_each_layer_and_head_to_itself(pair, tmp_path):
    folder = pair[0]
    m = iam_map.build_map(folder, folder, tokens=128, seqlen=64, skip_first=0)
    L = BIG["num_hidden_layers"]
    assert m["layer_map"] == list(range(L))
    assert m["head_map"] == [list(range(4))] * L
    assert all(abs(s - 1) < 1e-5 for s in m["similarity"])
    path = iam_map.save_map(m, tmp_path / "self.iam.json")
    model, _ = load_iam(folder, folder, L, path)
    ids = ids_of((1, 30), seed=3)
    with torch.no_grad():
        got = model(ids, new_cache(model, "full", 1, 30))
        want = pair[2](ids).logits
    assert rel_err(got, want) < 1e-5


def test_similarity_matches_float64_transformers_attention(pair):
    folder_big, folder_small, big, small = pair
    samples = ids_of((2, 20), seed=5)
    got = iam_map.similarity(load(folder_big)[0], load(folder_small)[0], samples)
    want = torch.zeros_like(got)
    for ids in samples:
        a = torch.stack(hf_attentions(big, ids[None]))[:, 0]  # [Ll, H, T, T]
        b = torch.stack(hf_attentions(small, ids[None]))[:, 0]
        for ly in range(a.shape[0]):
            for h in range(a.shape[1]):
                for ls in range(b.shape[0]):
                    for hs in range(b.shape[1]):
                        x, y = a[ly, h].flatten(), b[ls, hs].flatten()
                        want[ly, h, ls, hs] += x @ y / (x.norm() * y.norm()) / len(samples)
    assert (got - want).abs().max() < 1e-5
    assert got.min() > 0  # attention weights are non-negative: a real, non-trivial comparison


def test_mapping_rule_picks_the_argmax():
    g = torch.Generator().manual_seed(0)
    cos = torch.rand(6, 3, 4, 2, generator=g, dtype=torch.float64)
    m = iam_map.choose(cos, skip_first=2)
    for ly in range(6):
        sims = [sum(max(cos[ly, h, s].tolist()) for h in range(3)) / 3 for s in range(4)]
        best = max(range(4), key=lambda s: sims[s])
        assert m["layer_map"][ly] == best
        assert abs(m["similarity"][ly] - sims[best]) < 1e-12
        assert m["head_similarity"][ly] == [max(cos[ly, h, best].tolist()) for h in range(3)]
        assert m["head_map"][ly] == [
            max(range(2), key=lambda k: cos[ly, h, best, k]) for h in range(3)
        ]
    assert sorted(m["order"]) == [2, 3, 4, 5]  # the first two layers are never mapped
    assert [m["similarity"][ly] for ly in m["order"]] == sorted(
        (m["similarity"][ly] for ly in m["order"]), reverse=True
    )
    assert iam_map.select(m, 2) == sorted(m["order"][:2])


def test_partial_mapping_prefill_and_decode_equal_float64_reference(pair, tmp_path):
    """Large layers 2 and 3 mapped onto the small model's layers 0 and 1 (heads of a 2-head
    model read by 4): prefill in chunks, then token-by-token decode, against the reference."""
    folder_big, folder_small, big, small = pair
    mapped, heads = {2: 1, 3: 0}, {2: [0, 1, 1, 0], 3: [1, 1, 0, 0]}
    large, _ = load_mapped(folder_big, list(mapped))
    little, _ = load(folder_small)
    iam = IAMModel(large, little, mapped, heads, chunk=7)
    ids = ids_of((2, 32), seed=7)
    want = reference_logits(big, small, mapped, heads, ids)
    cache = new_cache(iam, "full", 2, 32)
    with torch.no_grad():
        parts = [iam(ids[:, :20], cache)]  # prefill: 3 chunks
        for t in range(20, 32):
            parts.append(iam(ids[:, t : t + 1], cache))
    assert rel_err(torch.cat(parts, 1), want) < 1e-5
    # bytes: the small model's K/V (2 layers, 1 KV head) + large: 2 layers K/V + 2 layers V only
    assert cache.nbytes() == 2 * 32 * 4 * 16 * (2 * 1 * 2 + 2 * 2 * 2 + 2 * 2 * 1)


def test_mapped_layers_hold_no_query_key_projection(pair):
    large, _ = load_mapped(pair[0], [3])
    attn = large.model.layers[3].self_attn
    assert not hasattr(attn, "q_proj") and not hasattr(attn, "k_proj")
    assert attn.qkv_proj.out_features == 2 * 16  # V only: KV heads x head_dim


def test_fp16_cache_counts_both_models(pair, tmp_path):
    """kv_bytes_per_token of the pair = the small model's fp16 K/V + the large one's K/V and V."""
    from compress.decoder.generate import generate

    folder_big, folder_small = pair[0], pair[1]
    m = iam_map.build_map(folder_big, folder_small, tokens=128, seqlen=64)
    path = iam_map.save_map(m, tmp_path / "m.json")
    model, _ = load_iam(folder_big, folder_small, 2, path)
    r = generate(model, [ids_of((12,)).tolist()], 5, kv="fp16", ignore_eos=True)
    small_layers = max(m["layer_map"][ly] for ly in model.mapped) + 1
    assert r.kv_bytes_per_token == 2 * 16 * (small_layers * 2 * 1 + 2 * 2 * 2 + 2 * 2 * 1)


def test_other_tokenizer_is_refused(pair, tmp_path):
    from transformers import PreTrainedTokenizerFast

    tok = tiny_tokenizer()
    tk = tok.backend_tokenizer
    tk.add_tokens(["<extra>"])
    other = save(tiny_hf(**SMALL), tmp_path / "other", PreTrainedTokenizerFast(tokenizer_object=tk))
    for call in (
        lambda: iam_map.build_map(pair[0], other, tokens=128, seqlen=64),
        lambda: load_iam(pair[0], other, 1, tmp_path / "x.json"),
    ):
        with pytest.raises(CompressError, match="same tokenizer|another vocabulary"):
            call()


def test_map_file_of_other_models_is_refused(pair, tmp_path):
    folder_big, folder_small = pair[0], pair[1]
    m = iam_map.build_map(folder_big, folder_small, tokens=128, seqlen=64)
    path = iam_map.save_map(m, tmp_path / "m.json")
    tok = tiny_tokenizer()
    other = tiny_hf(**BIG)
    with torch.no_grad():
        other.model.embed_tokens.weight.mul_(1.5)  # same config and tokenizer, other weights
    other_dir = save(other, tmp_path / "other", tok)
    with pytest.raises(CompressError, match="made for another large model.*embed_sha"):
        load_iam(other_dir, folder_small, 1, path)
    with pytest.raises(CompressError, match="made for another small model"):
        load_iam(folder_big, folder_big, 1, path)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(CompressError, match="not valid JSON"):
        load_iam(folder_big, folder_small, 1, tmp_path / "bad.json")
    with pytest.raises(CompressError, match="--iam-layers 5"):
        load_iam(folder_big, folder_small, 5, path)
    with pytest.raises(CompressError, match="--iam-layers 'x'"):
        iam_map.select(m, "x")


def test_iam_generate_cli(pair, tmp_path, capsys):
    """``python -m compress.cli.iam generate`` runs the decoder CLI with the pair: its text equals
    the pair's own greedy generation; the decoder's old ``--iam`` flag names the new command."""
    from compress.cli.iam import main
    from compress.decoder.__main__ import main as decoder_main
    from compress.decoder.generate import generate

    folder_big, folder_small = pair[0], pair[1]
    path = iam_map.save_map(
        iam_map.build_map(folder_big, folder_small, tokens=128, seqlen=64), tmp_path / "m.json"
    )
    main(["generate", str(folder_big), "--prompt", "the quick brown fox", "--max-new-tokens", "4",
          "--json", "--small", str(folder_small), "--iam-layers", "2", "--iam-map", str(path),
          "--no-warmup"])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert out["kv_bytes_per_token"] > 0
    model, tok = load_iam(folder_big, folder_small, 2, path)
    ref = generate(model, [tok("the quick brown fox").input_ids], 4, tok)
    assert out["text"] == ref.texts[0]
    with pytest.raises(SystemExit) as e:
        main(
            ["generate", str(folder_big), "--prompt", "x", "--iam", str(folder_small), "--compile"]
        )
    assert e.value.code == 2 and "leave out --draft and --compile" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        decoder_main([str(folder_big), "--prompt", "x", "--iam", str(folder_small)])
    assert e.value.code == 2 and "python -m compress.cli.iam generate" in capsys.readouterr().err


def test_iam_recipe_self_mapped_equals_the_source(tiny_dir, tmp_path):
    """The stage on the tiny model mapped onto itself, every layer: the report's ppl is the
    source's (transformers), its KL ~0, and the run folder carries the mapping."""
    from compress.recipe.pipeline import run

    cfg = compose(
        "iam",
        [f"model.path={tiny_dir}", *TINY_OVERRIDES, "decode.new_tokens=4", f"iam.small={tiny_dir}",
         "iam.skip_first=0", "iam.layers=2", "iam.tokens=128", "iam.seqlen=64"],
    )  # fmt: skip
    rep = run(cfg, tmp_path / "iam")
    assert abs(rep["ppl"] - rep["source_ppl"]) / rep["source_ppl"] < 1e-5
    assert rep["kl_vs_source"] < 1e-6
    assert rep["iam"]["layers"] == [0, 1] and rep["iam"]["layer_map"] == {0: 0, 1: 1}
    assert rep["iam"]["small_weight_bytes"] > 0
    m = json.loads((tmp_path / "iam" / "iam_map.json").read_text())
    assert m["layer_map"] == [0, 1]
    # fp16: the small model's K and V, and the large one's V, in every layer
    c = json.loads((tiny_dir / "config.json").read_text())
    d = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    per_layer = 3 * c["num_key_value_heads"] * d * 2
    assert rep["kv_bytes_per_token"] == c["num_hidden_layers"] * per_layer


def test_iam_recipe_refuses_bad_settings_before_loading(tiny_dir, tmp_path, monkeypatch):
    import compress.recipe.pipeline as pipeline
    from compress.recipe.pipeline import run

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the settings were checked")

    monkeypatch.setattr(pipeline, "load_model", refuse)
    base = [f"model.path={tiny_dir}", *TINY_OVERRIDES]
    with pytest.raises(CompressError, match="iam.small"):
        run(compose("iam", base), tmp_path / "x")
    with pytest.raises(CompressError, match="iam.layers"):
        run(compose("iam", [*base, f"iam.small={tiny_dir}", "iam.layers=-1"]), tmp_path / "y")
    other = save(tiny_hf(**SMALL), tmp_path / "other", tiny_tokenizer())  # a 300-token vocabulary
    with pytest.raises(CompressError, match="another vocabulary"):
        run(compose("iam", [*base, f"iam.small={other}"]), tmp_path / "z")

"""Every method on every family (llama with llama3 RoPE scaling, mistral's window, qwen2's biases
and windowed layer, qwen3's q/k norms, gemma3_text's local/global layers and four (1+w) norms):
each recipe runs, or is refused before any weight loads with a CompressError naming why.

References: transformers' own modeling code (the saved folders loaded by ``from_pretrained``,
or by ``compress.io.checkpoint.load_run``, which is transformers' model class with the quantized
layers swapped in) against our decoder (``compress.decoder.model.load``), float64 folds.
"""

import math

import pytest
import torch

from compress.arch.spec import spec_of
from compress.errors import CompressError
from compress.recipe.config import validate
from compress.recipe.pipeline import run
from tests.conftest import compose
from tests.family_models import FAMILIES, VOCAB, family_config, family_model

SMALL = [
    "eval.windows=1",
    "eval.seqlen=32",
    "eval.compare_source=false",
    "calib.samples=2",
    "calib.seqlen=48",
    "decode.enabled=false",
]
EXTRA = {  # tiny-model settings of each recipe (no distillation: the stage is not under test)
    "awq_int4": ["awq.n_grid=4", "awq.search_samples=2"],
    "awq_int3": ["awq.n_grid=4", "awq.search_samples=2"],
    "llm_int8": ["llm_int8.outlier_stats=false"],
    "gqa": ["attn.kv_heads=1", "distill.tokens=0"],
    "cla": ["distill.tokens=0", "attn.cla_init=first"],
    "mla": [
        "distill.tokens=0",
        "mla.d_kv=8",
        "mla.rope_pairs=4",
        "mla.rope_select=uniform",
        "mla.svd=weights",
    ],  # fmt: skip
    "minitron_width": [
        "distill.tokens=0",
        "prune.target_params=null",
        "prune.cache=false",
        "prune.export.hidden_size=48",
        "prune.export.intermediate_size=64",
    ],  # fmt: skip
    "minitron_depth": [
        "distill.tokens=0",
        "prune.cache=false",
        "prune.export.num_hidden_layers=1",
    ],  # fmt: skip
}
QUANT = ("rtn_int4", "rtn_int3", "rtn_int8", "awq_int4", "awq_int3")
# a cross-section runs with the suite; the rest of the family x recipe matrix with -m matrix
CROSS = {("gemma3_text", "awq_int4"), ("gemma3_text", "minitron_width"),
        ("qwen3", "rtn_int4"), ("mistral", "awq_int4"), ("llama", "awq_int3"),
        ("qwen2", "rtn_int8"), ("gemma3_text", "rtn_int3"), ("gemma3_text", "minitron_depth"),
        ("qwen3", "gqa")}  # fmt: skip
MATRIX = pytest.mark.matrix


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run_on(recipe, folder, out, *extra):
    overrides = [f"model.path={folder}", *SMALL, *EXTRA.get(recipe, []), *extra]
    return run(compose(recipe, overrides), out)


def tokens(n=128, seed=0):
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def decoder_logits(folder, ids):
    from compress.decoder.kv import new_cache
    from compress.decoder.model import load

    model, _ = load(folder)
    with torch.no_grad():
        return model(ids, new_cache(model, "full", 1, ids.shape[1]))[0]


def hf_logits(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits[0].float()


def matrix(recipes):
    return [
        pytest.param(f, r, marks=() if (f, r) in CROSS else MATRIX)
        for f in FAMILIES
        for r in recipes
    ]


# ---- AWQ's scale groups, from the spec ---------------------------------------------------------


@pytest.mark.parametrize("mha", [False, True], ids=["gqa", "mha"])
@pytest.mark.parametrize("family", FAMILIES)
def test_awq_folds_keep_the_function(family, mha):
    """Every group's fold (norm -> q/k/v with (offset + w), post_norm -> gate/up, v -> o for MHA,
    up -> down) leaves transformers' logits unchanged in float64; folding Gemma's norms as if
    they were w * x_hat (offset 0) does not."""
    from compress.methods.quant.awq import apply_scale, scale_groups

    extra = {"num_key_value_heads": 4} if mha else {}
    ids = tokens(40)
    model = family_model(family, **extra).double()
    spec = spec_of(model.config)
    reference = hf_logits(model, ids)
    gen = torch.Generator().manual_seed(1)
    names = []
    for layer in spec.adapter.decoder_layers(model):
        for group in scale_groups(layer, spec.adapter):
            n = group["linears"][0].in_features
            s = torch.rand(n, generator=gen, dtype=torch.float64) * 1.5 + 0.5
            apply_scale(group["prev"], group["linears"], s, spec.norm_offset)
            names.append(group["name"])
    assert ("o" in names) == mha  # v -> o only where v's and o's shapes match
    assert {"qkv", "gate_up", "down"} <= set(names)
    # float64 but for Gemma's RMSNorm, which transformers computes in float32
    assert rel_err(hf_logits(model, ids), reference) < (1e-5 if spec.norm_offset else 1e-10)
    if spec.norm_offset:
        wrong = family_model(family, **extra).double()
        layer = spec.adapter.decoder_layers(wrong)[0]
        group = scale_groups(layer, spec.adapter)[0]
        s = torch.rand(group["linears"][0].in_features, generator=gen, dtype=torch.float64) + 0.5
        apply_scale(group["prev"], group["linears"], s, 0.0)
        assert rel_err(hf_logits(wrong, ids), reference) > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_awq_layer_kwargs_run_each_layer_as_the_model_does(family):
    """Run layer by layer with ``layer_kwargs`` (a prompt longer than the window: masks and
    Gemma's local/global RoPE differ per layer), the hidden states are transformers' own;
    with layer 0's arguments for every layer they are not, where layers differ."""
    from compress.methods.quant.awq import capture_inputs, layer_kwargs

    model = family_model(family)
    spec = spec_of(model.config)
    ids = torch.cat([tokens(48, 2), tokens(48, 3)])
    with torch.no_grad():
        hidden = model(ids, use_cache=False, output_hidden_states=True).hidden_states
        x, _ = capture_inputs(model, spec.adapter, ids, 2)
        per_layer = layer_kwargs(model, spec.adapter, ids)
        layers = spec.adapter.decoder_layers(model)
        y = x
        for i, layer in enumerate(layers):
            assert rel_err(y, hidden[i]) < 1e-6
            y = layer(y, **per_layer[i])
        final = model.get_submodule(spec.adapter.final_norm)(y)
        assert rel_err(final, hidden[-1]) < 1e-6
        kinds = {(layer.window, layer.rope) for layer in spec.layers}
        if len(kinds) > 1:  # gemma3_text, qwen2
            y = x
            for layer in layers:
                y = layer(y, **per_layer[0])
            assert rel_err(model.get_submodule(spec.adapter.final_norm)(y), hidden[-1]) > 1e-3


@pytest.mark.parametrize(
    "family",
    [f if f == "gemma3_text" else pytest.param(f, marks=MATRIX) for f in FAMILIES],
)
def test_awq_stage_keeps_the_function_like_rtn(family):
    """The awq stage at 8 bits (folds + search, no clip) is within 1.5x of RTN's error against the
    float model; a fold that ignored Gemma's (1 + w) (offset 0) is 4x off."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from compress.methods.quant.awq import awq
    from compress.methods.quant.rtn import pack_model

    cfg = OmegaConf.create({"awq": dict(bits=8, group_size="auto", duo_scaling=False, n_grid=4,
                                        clip=False, search_samples=2, batch=4)})  # fmt: skip
    calib = torch.cat([tokens(48, i) for i in range(4)])
    ids = tokens(64, 9)
    reference = hf_logits(family_model(family), ids)
    ctx = SimpleNamespace(cfg=cfg, calibration=lambda: calib, record={})
    model = awq(family_model(family), ctx)
    g = ctx.record["group_size"]
    rtn_err = rel_err(hf_logits(pack_model(family_model(family), 8, g), ids), reference)
    assert rel_err(hf_logits(model, ids), reference) < 1.5 * rtn_err


def test_gemma3_270m_shapes():
    """Gemma 3 270M's shapes (640 hidden, 2048 MLP, 4 heads of 256, 1 KV head, 262k tied head):
    group size auto is 128 (it divides 640, 1024 and 2048); v -> o is not a group (v is 256 x 640,
    o 640 x 1024); the head is tied, so no decoder linear of the quantized set is the head."""
    from transformers import Gemma3TextConfig

    from compress.arch.adapters import layer_in_features
    from compress.formats.quantizer import auto_group_size, check_group_size

    config = Gemma3TextConfig(
        vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
        query_pre_attn_scalar=256,
    )  # fmt: skip
    spec = spec_of(config)
    assert spec.tied and spec.norm_offset == 1 and spec.sandwich and spec.qk_norm
    assert [layer.window for layer in spec.layers].count(None) == 3  # layers 5, 11, 17
    features = layer_in_features(config)
    assert sorted(set(features.values())) == [640, 1024, 2048]
    assert auto_group_size(list(features.values())) == 128
    check_group_size("auto", features, "awq.group_size")
    shapes = spec.adapter.linear_shapes(config)
    assert shapes["self_attn.v_proj"] == (256, 640) and shapes["self_attn.o_proj"] == (640, 1024)
    assert all(not p.startswith("lm_head") for p in shapes)
    with pytest.raises(CompressError, match="256"):
        check_group_size(256, features, "awq.group_size")  # 640 = 5 x 128


# ---- the recipes, per family -------------------------------------------------------------------


@pytest.mark.parametrize("family,recipe", matrix(QUANT))
def test_quantized_folder_agrees_with_transformers(family, recipe, family_dirs, tmp_path):
    """The folder loads with transformers' modeling code (load_run: the family's HF class with the
    quantized layers) and our decoder computes the same logits on 128 tokens (past the window)."""
    from compress.io.checkpoint import load_run

    out = tmp_path / "run"
    report = run_on(recipe, family_dirs[family], out)
    assert math.isfinite(report["ppl"])
    ids = tokens()
    hf, _ = load_run(out)
    assert type(hf).__name__ == type(family_model(family)).__name__
    assert rel_err(decoder_logits(out, ids), hf_logits(hf, ids)) < 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_awq_folder_loads_with_from_pretrained(family, family_dirs, tmp_path):
    """transformers' own AWQ loader (``quant_method: awq``, through gptqmodel's kernels) reads the
    INT4 folder in AutoAWQ's layout (``quant.format=autoawq``) with no flags: every quantized linear becomes its AWQ module, dequantizing to our
    weights bit for bit in the config's float16, and its logits agree with our decoder's."""
    pytest.importorskip("gptqmodel", reason="the interop extra: pip install -e '.[interop]'")
    from transformers import AutoModelForCausalLM

    from compress.io.checkpoint import load_run
    from compress.layers.quant_linear import QuantLinear

    out = tmp_path / "run"
    run_on("awq_int4", family_dirs[family], out, "quant.format=autoawq")
    hf = AutoModelForCausalLM.from_pretrained(out).eval()  # no flags
    assert hf.dtype == torch.float16  # AutoAWQ's convention, from config.json
    ours, _ = load_run(out)
    quantized = {n: m for n, m in ours.named_modules() if isinstance(m, QuantLinear)}
    assert quantized
    for name, layer in quantized.items():
        theirs = hf.get_submodule(name)
        assert "Awq" in type(theirs).__name__, (name, type(theirs))
        # (q - z) * s is exact in float32 from float16 scales: one rounding to float16 either way
        assert torch.equal(theirs.dequantize_weight().t(), layer.dequantize().half())
    ids = tokens()
    reference = decoder_logits(out, ids)
    # in float32 gptqmodel still dequantizes with the float16 scales, in float16 (4e-4 here)
    fp32 = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert rel_err(hf_logits(fp32, ids), reference) < 1e-3
    # the no-flag float16 model: float16 activations cost Gemma's 6 random layers about 2e-3
    # (the same folder in float16 against float32 transformers), the others under 1e-3
    fp16_cost = rel_err(hf_logits(hf, ids), hf_logits(fp32, ids))
    assert rel_err(hf_logits(hf, ids), reference) < max(1e-3, 1.5 * fp16_cost)


@pytest.mark.parametrize(
    "family",
    [pytest.param(f, marks=() if f in ("llama", "gemma3_text") else MATRIX) for f in FAMILIES],
)
def test_fp_folder_loads_in_transformers(family, family_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    run_on("fp", family_dirs[family], out)
    hf = AutoModelForCausalLM.from_pretrained(out).eval()  # no flags
    ids = tokens()
    assert rel_err(decoder_logits(out, ids), hf_logits(hf, ids)) < 1e-4


@pytest.mark.parametrize(
    "family",
    [pytest.param(f, marks=() if f == "gemma3_text" else MATRIX) for f in FAMILIES],
)
def test_llm_int8_folder_loads_through_bitsandbytes(family, family_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    from compress.io.checkpoint import load_run

    out = tmp_path / "run"
    run_on("llm_int8", family_dirs[family], out)
    hf = AutoModelForCausalLM.from_pretrained(out, device_map="cpu").eval()
    assert any(type(m).__name__ == "Linear8bitLt" for m in hf.modules())
    ours, _ = load_run(out)
    spec = spec_of(hf.config)
    theirs = spec.adapter.all_linears(hf)
    for name, lin in spec.adapter.all_linears(ours).items():  # the same int8 codes, every family
        assert torch.equal(theirs[name].weight.data, lin.weight)
    ids = tokens(64)
    # bitsandbytes' CPU int8 path (fp16 activations) and ours round activations differently: the
    # two differ by about the int8 error itself (each ~4% from the float source on Gemma's 6
    # random layers, 3% from each other; fp16 alone costs 0.2%)
    assert rel_err(hf_logits(hf, ids), hf_logits(ours, ids)) < 5e-2


@pytest.mark.parametrize("family,recipe", matrix(("minitron_width", "minitron_depth", "gqa")))
def test_structural_recipes_run(family, recipe, family_dirs, tmp_path):
    """Pruned / pooled folders load in transformers (no flags) and our decoder agrees; depth
    pruning carries the kept layers' types (Gemma's local/global pattern)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = tmp_path / "run"
    run_on(recipe, family_dirs[family], out)
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    config = AutoConfig.from_pretrained(out)
    source = family_config(family)
    if recipe == "minitron_width":
        assert config.hidden_size == 48 and config.intermediate_size == 64
    if recipe == "minitron_depth":
        assert config.num_hidden_layers == 1
        if getattr(source, "layer_types", None):
            assert config.layer_types[0] in source.layer_types
    if recipe == "gqa":
        assert config.num_key_value_heads == 1
    ids = tokens()
    assert rel_err(decoder_logits(out, ids), hf_logits(hf, ids)) < 1e-4


@pytest.mark.parametrize("recipe", ["cla", "mla"])
@pytest.mark.parametrize("family", FAMILIES)
def test_cla_mla_run_or_refuse_before_loading(family, recipe, family_dirs, tmp_path, monkeypatch):
    """CLA/MLA convert into Llama layers: llama converts; every family with q/k norms, (1+w)
    norms, q/k/v-only biases or sliding windows is refused by validation from config.json."""
    cfg = compose(recipe, [f"model.path={family_dirs[family]}", *SMALL, *EXTRA[recipe]])
    spec = spec_of(family_config(family))
    biases = spec.qkv_bias != spec.o_bias
    llama_like = not (spec.qk_norm or spec.sandwich or spec.windowed or biases)
    if not llama_like:
        import compress.recipe.pipeline as pipeline

        monkeypatch.setattr(pipeline, "load_model", lambda *a, **k: pytest.fail("loaded"))
        with pytest.raises(CompressError, match=f"'{family}' model has") as e:
            run(cfg, tmp_path / "run")
        assert "\n" not in str(e.value) and "gqa recipe" in str(e.value)
        return
    out = tmp_path / "run"
    run(cfg, out)
    from compress.io.checkpoint import load_run

    ids = tokens()
    hf, _ = load_run(out)
    assert rel_err(decoder_logits(out, ids), hf_logits(hf, ids)) < 1e-4


def test_iam_refuses_windowed_models(family_dirs, tmp_path):
    cfg = compose("iam", [f"model.path={family_dirs['gemma3_text']}",
                          f"iam.small={family_dirs['gemma3_text']}", *SMALL])  # fmt: skip
    with pytest.raises(CompressError, match="sliding-window attention on layers"):
        validate(cfg)


def test_refusals_name_the_layout(family_dirs):
    """Head layouts a method cannot meet are refused from config.json by validation."""
    cfg = compose("gqa", [f"model.path={family_dirs['qwen3']}", *SMALL, "attn.kv_heads=3"])
    with pytest.raises(CompressError, match="kv_heads must divide 2"):
        validate(cfg)
    cfg = compose("cla", [f"model.path={family_dirs['llama']}", *SMALL, "attn.share=3"])
    with pytest.raises(CompressError, match="must divide the model's 2 layers"):
        validate(cfg)


# ---- Minitron on Gemma: importance over four norms, the embedding scale ------------------------


def test_minitron_gemma_norms_and_embedding_scale():
    """Importance reads Gemma's four norms per layer; pruning hidden channels slices all four and
    keeps the embedding's scale: the pruned embedding output equals the source's on the kept
    channels, and the tied head with the final norm computes, in float64, what the source's
    weights restricted to those channels compute."""
    from compress.methods.prune.importance import activation_importance
    from compress.methods.prune.prune import _top, layout_of, param_count, prune_model, sizes_of

    model = family_model("gemma3_text").double()
    spec = spec_of(model.config)
    assert param_count(layout_of(model), sizes_of(model.config)) == sum(
        p.numel() for p in model.parameters()
    )
    scores = activation_importance(model.float(), tokens(32).view(2, 16), progress=False)
    model = model.double()
    assert scores["norm_channels"].shape == (6, 4, 64)
    pruned = prune_model(model, scores, {"hidden_size": 48, "num_hidden_layers": 4}).double()
    keep = _top(scores["channels"], 48)
    kept = _top(scores["block"], 4)
    assert pruned.config.layer_types == [model.config.layer_types[i] for i in kept.tolist()]
    for j, i in enumerate(kept.tolist()):
        for n in spec.adapter.norms():
            w = pruned.model.layers[j].get_submodule(n).weight
            assert torch.equal(w, model.model.layers[i].get_submodule(n).weight[keep])
    ids = tokens(8)
    with torch.no_grad():
        embedded = model.model.embed_tokens(ids)[..., keep]
        assert rel_err(pruned.model.embed_tokens(ids), embedded) < 1e-6
        h = torch.randn(1, 8, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
        w = model.model.norm.weight[keep]
        x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + model.config.rms_norm_eps)
        reference = ((1 + w) * x) @ model.model.embed_tokens.weight[:, keep].T
        assert rel_err(pruned.lm_head(pruned.model.norm(h)), reference) < 1e-6  # float32 norm


# ---- speculative drafts across families ---------------------------------------------------------


def test_draft_of_another_family(family_dirs, tokenizer, tmp_path):
    """A draft of another family with the target's tokenizer loads (each runs its own spec); one
    with another vocabulary is refused from its config.json, before any weight is read."""
    from compress.decoder.model import load
    from compress.decoder.speculative.drafts import load_draft

    target, _ = load(family_dirs["llama"])
    draft = load_draft(family_dirs["gemma3_text"], target, tokenizer)
    assert draft.spec.family == "gemma3_text" and draft.spec.vocab_size == VOCAB
    family_config("gemma3_text", vocab_size=1024).save_pretrained(tmp_path)  # no weights at all
    with pytest.raises(CompressError, match="1024 tokens and the target's 49152"):
        load_draft(tmp_path, target, tokenizer)

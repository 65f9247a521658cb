"""The rotation stage (``compress.methods.quant.rotate``): Hadamard matrices against their
definition, the folded rotation against transformers' own forward of the unrotated model in
float64 for every family it takes, refusals, and what it does for RTN on outlier channels."""

import pytest
import torch
from omegaconf import OmegaConf

from compress.errors import CompressError
from compress.formats.quantizer import quantize
from compress.methods.quant.rotate import check, hadamard, rotate_model, rotation
from tests.family_models import family_config

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]


@pytest.mark.parametrize("n", [2, 4, 12, 20, 24, 40, 48, 64, 576, 640])
def test_hadamard_orders(n):
    h = hadamard(n)
    assert h is not None and h.shape == (n, n) and set(h.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64))


@pytest.mark.parametrize("n,kind", [(576, "hadamard"), (6, "hadamard"), (64, "orthogonal")])
def test_rotation_is_orthogonal_and_seeded(n, kind):
    q = rotation(n, kind, seed=3)
    assert torch.allclose(q @ q.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    assert torch.equal(q, rotation(n, kind, seed=3)) and not torch.equal(q, rotation(n, kind, 4))
    if kind == "hadamard" and hadamard(n) is not None:  # entries +-1/sqrt(n): spread evenly
        assert torch.allclose(q.abs(), torch.full((n, n), n**-0.5, dtype=torch.float64))


def randomize(model) -> None:
    """Norm weights, biases, sinks and weights away from their init (ones and zeros would make
    folding them a no-op)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.4 * torch.randn_like(p))
            elif name.endswith(("bias", "sinks")):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))


def randomized(family: str, dtype=torch.float64, **overrides):
    """A tiny random model of ``family`` (:func:`randomize`)."""
    from transformers import AutoModelForCausalLM

    config = family_config(family, vocab_size=512, **overrides)
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    randomize(model)
    return model


@torch.no_grad()
def rotated(model, vocab: int) -> tuple[float, list[str]]:
    """``(relative logit change, names of the parameters the rotation changed)``."""
    ids = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))
    ref = model(ids).logits
    before = {n: p.clone() for n, p in model.named_parameters()}
    rotate_model(model, seed=5)
    out = model(ids).logits
    moved = [
        n for n, p in model.named_parameters() if n in before and not torch.equal(p, before[n])
    ]
    return rel(out, ref), moved


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("hidden", [64, 48])  # 48 = Paley 12 x Sylvester 4
def test_rotation_keeps_the_logits_in_float64(family, hidden):
    model = randomized(family, hidden_size=hidden)
    err, moved = rotated(model, 512)
    assert err < 1e-5
    assert any("q_proj" in n for n in moved) and any("embed_tokens" in n for n in moved)
    norms = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    assert all(torch.equal(p, torch.ones_like(p)) for p in norms if p.numel() == hidden)


@pytest.mark.parametrize(
    "family",
    ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "deepseek_v3_yarn", "gpt_oss"],
)
def test_rotation_keeps_mixture_of_experts_logits_in_float64(family):
    """Routers, fused experts (gpt-oss's transposed ones with their biases), shared experts and
    their gate, dense layers and DeepSeek V3's latent attention rotated: transformers' own
    float64 forward gives the source's logits, and every expert tensor changed."""
    from transformers import AutoModelForCausalLM

    from tests.test_moe import moe_config

    config = moe_config(family)
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float64, experts_implementation="eager"
    ).eval()
    randomize(model)
    err, moved = rotated(model, config.vocab_size)
    assert err < 1e-5
    for part in (
        "experts.gate_up_proj",
        "experts.down_proj",
        ".router." if family == "gpt_oss" else ".gate.",
    ):
        assert any(part in n for n in moved), part


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
@torch.no_grad()
def test_rotation_keeps_per_expert_linears_logits_in_float64(family):
    """Experts unfused into one gated MLP per expert (``compress.layers.experts``, as awq, gptq
    and rtn hold them; awq.quantize=false hands them on to a later stage): every expert's gate,
    up and down linears rotated (Mixtral's w1/w3/w2, qwen2_moe's shared expert beside them), and
    the logits are transformers' own float64 forward of the fused, unrotated source."""
    import copy

    from transformers import AutoModelForCausalLM

    from compress.arch.adapters import get_adapter
    from compress.layers.experts import LinearExperts, unfuse_experts
    from tests.test_moe import moe_config

    config = moe_config(family)
    fused = AutoModelForCausalLM.from_config(
        config, dtype=torch.float64, experts_implementation="eager"
    ).eval()
    randomize(fused)
    model = copy.deepcopy(fused)
    a = get_adapter(model.config)
    assert unfuse_experts(model, a) > 0
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    ref = fused(ids).logits
    err, moved = rotated(model, config.vocab_size)
    assert err < 1e-5
    assert rel(model(ids).logits, ref) < 1e-5
    for layer in a.decoder_layers(model):
        experts = getattr(layer.get_submodule(a.mlp), "experts", None)
        if not isinstance(experts, LinearExperts):
            continue  # a dense layer
        prefix = next(n for n, m in model.named_modules() if m is experts)
        for e in range(experts.n_experts):
            for name in a.expert_names:
                assert f"{prefix}.{e}.{name}.weight" in moved, (prefix, e, name)


@pytest.mark.parametrize("kind", ["mla", "cla"])
def test_rotation_keeps_converted_attention_logits_in_float64(kind):
    """Our MLA (q, the RoPE key and the latent read the stream; the latent's up-projections do
    not) and CLA (later layers without k/v) folders rotate exactly."""
    from compress.methods.attn.cla import convert_cla
    from compress.methods.attn.mla import convert_mla
    from tests.conftest import make_tiny_model

    base = make_tiny_model().double()
    randomize(base)
    model = convert_mla(base, 16, 4, "uniform") if kind == "mla" else convert_cla(base, 2, "first")
    model = model.double().eval()
    err, _ = rotated(model, 256)
    assert err < 1e-5
    assert model.config.model_type == f"compress_{kind}"


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_rotate_stage_writes_a_mixture_of_experts_folder_transformers_reads(
    family, tokenizer, tmp_path
):
    """``stages=[rotate]`` on a mixture-of-experts folder (disk-backed, one layer at a time):
    stock transformers reads the run folder and gives the source's logits."""
    from transformers import AutoModelForCausalLM

    from compress.recipe.pipeline import run
    from tests.conftest import TINY_OVERRIDES, compose
    from tests.test_moe import moe_config

    src = tmp_path / "src"
    model = AutoModelForCausalLM.from_config(moe_config(family, vocab_size=tokenizer.vocab_size))
    randomize(model)
    model.save_pretrained(src)
    tokenizer.save_pretrained(src)
    over = [f"model.path={src}", "stages=[rotate]", "decode.enabled=false", *TINY_OVERRIDES]
    report = run(compose("fp", over), tmp_path / "run")
    assert "rotate" in report["stages"]
    load = dict(dtype=torch.float32, experts_implementation="eager")
    ref = AutoModelForCausalLM.from_pretrained(src, **load).eval()
    out = AutoModelForCausalLM.from_pretrained(tmp_path / "run", **load).eval()
    ids = torch.randint(0, 512, (1, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel(out(ids).logits, ref(ids).logits) < 1e-4
    assert not torch.equal(out.model.embed_tokens.weight, ref.model.embed_tokens.weight)


def test_tied_head_is_untied():
    model = randomized("llama")  # the tiny llama ties its head
    assert model.config.tie_word_embeddings
    err, _ = rotated(model, 512)
    assert not model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert err < 1e-5


def test_refusals():
    with pytest.raises(CompressError, match="norms on the attention and MLP outputs"):
        rotate_model(randomized("gemma3_text", dtype=torch.float32))
    cfg = OmegaConf.create({"stages": ["rotate"], "rotate": {"kind": "givens", "seed": 0}})
    with pytest.raises(CompressError, match="rotate.kind='givens'"):
        check(cfg)
    cfg = OmegaConf.create({"stages": ["rotate"], "rotate": {"kind": "hadamard", "seed": -1}})
    with pytest.raises(CompressError, match="rotate.seed=-1"):
        check(cfg)
    with pytest.raises(CompressError, match="norms on the attention"):
        check(OmegaConf.create({"rotate": {}}), family_config("gemma3_text"))


def test_stage_order_is_checked_when_composed():
    from compress.recipe.config import check_stage_list
    from compress.recipe.overrides import compose

    with pytest.raises(CompressError, match="awq replaces the linears"):
        check_stage_list(compose("awq_int4", ["stages=[awq,rotate]"]))
    check_stage_list(compose("awq_int4", ["stages=[rotate,awq]"]))


def test_rotation_helps_rtn_on_outlier_channels():
    """A linear reading the residual stream with outlier input channels in its weight and its
    input: group-wise INT4 RTN rounds the rest of those groups coarsely; after the rotation
    (W Q, x Q: the same output) the outliers are spread over all channels, and RTN's output
    error is less than half of what it was. (On real models: ``BENCHMARKS.md``.)"""
    gen = torch.Generator().manual_seed(0)
    n = 576  # SmolLM2's width: Paley 12 x 12 x Sylvester 4
    w, x = torch.randn(256, n, generator=gen) * 0.05, torch.randn(512, n, generator=gen)
    x[:, :4] *= 20
    w[:, 10:14] *= 15
    q = rotation(n, seed=0).float()

    def rtn_error(w, x):
        w_hat = quantize(w, 4, 32).dequantize()
        return rel(x @ w_hat.T, x @ w.T)

    plain, rotated = rtn_error(w, x), rtn_error(w @ q, x @ q)
    assert rotated < 0.5 * plain, (rotated, plain)

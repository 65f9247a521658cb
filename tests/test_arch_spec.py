"""The architecture spec (``compress.arch.spec``) against transformers' own modules built from the same
config, and the refusals of what the decoder cannot run, before any weight is read."""

import ast
import json
from pathlib import Path

import pytest
import torch

from compress.arch.adapters import ADAPTERS, get_adapter
from compress.arch.spec import spec_of
from compress.decoder.model import load, rope_inv_freq
from compress.errors import CompressError
from tests.family_models import FAMILIES as MODEL_FAMILIES
from tests.family_models import family_config as models_config
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
            {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
            "RoPE type 'dynamic'",
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


# --- the spec is the runtime's only door to the architecture -------------------------------------

RUNTIME = ("compress/decoder", "compress/serve")
CONFIG_NAMES = ("config", "cfg", "hf_config")
# reads of a ``config`` in the runtime that are not a model's, each with why it remains
ALLOWED_CONFIG_READS = {
    ("compress/serve/server.py", "self.config.host"): "uvicorn.Server's settings, not a model's",
}


def config_reads(path) -> list[tuple[int, str]]:
    """``(line, source)`` of every read of a ``.config`` attribute, of an attribute of a variable
    named like a config, of ``getattr`` on either, and of every write into a config's attributes,
    in the Python file ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    out, nodes = [], list(ast.walk(tree))
    # ``x.config`` inside ``x.config.y``: the outer attribute is the one reported
    inner = {id(n.value) for n in nodes if isinstance(n, ast.Attribute)}
    for node in nodes:
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            v = node.value
            of_config = (isinstance(v, ast.Name) and v.id in CONFIG_NAMES) or (
                isinstance(v, ast.Attribute) and v.attr == "config"
            )
            read = isinstance(node.ctx, ast.Load) and (node.attr == "config" or of_config)
            if read or (isinstance(node.ctx, ast.Store) and of_config):  # or a config mutated
                out.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in (
            "getattr",
            "hasattr",
        ):
            target = node.args[0] if node.args else None
            name = node.args[1] if len(node.args) > 1 else None
            if (isinstance(target, ast.Name) and target.id in CONFIG_NAMES) or (
                isinstance(name, ast.Constant) and name.value == "config"
            ):
                out.append((node.lineno, ast.unparse(node)))
    return sorted(out)


def test_runtime_reads_the_spec_not_the_config():
    """compress/decoder and compress/serve read the architecture from ``model.spec`` (and caches
    from ``model.kv_layout()``), never from an HF config; the allow-list names each exception."""
    root = Path(__file__).resolve().parent.parent
    found, used = [], set()
    for folder in RUNTIME:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            for line, src in config_reads(path):
                if (rel, src) in ALLOWED_CONFIG_READS:
                    used.add((rel, src))
                else:
                    found.append(f"{rel}:{line}: {src}")
    assert not found, "read the spec (model.spec) instead:\n" + "\n".join(found)
    assert used == set(ALLOWED_CONFIG_READS), "an allow-list entry is no longer needed"


def test_config_read_check_catches_reads(tmp_path):
    """The check above flags each way of reading a config (so its silence means something)."""
    f = tmp_path / "m.py"
    f.write_text(
        "def f(model, config):\n"
        "    a = model.config.vocab_size\n"
        "    c = model.config\n"
        "    b = config.num_hidden_layers\n"
        "    d = getattr(config, 'head_dim', None)\n"
        "    e = getattr(model, 'config')\n"
        "    config.iam_mapped = [1]\n"
        "    model.config = None\n"
        "    return model.spec.vocab_size\n"
    )
    assert [line for line, _ in config_reads(f)] == [2, 3, 4, 5, 6, 7]


def hf_head_dim(hf) -> int:
    """transformers' head width: its attention's ``head_dim`` and the q projection's rows / heads."""
    attn = hf.model.layers[0].self_attn
    heads = hf.config.num_attention_heads
    assert attn.q_proj.out_features == heads * attn.head_dim
    return attn.head_dim


@pytest.mark.parametrize("head_dim", [None, 32])
@pytest.mark.parametrize("family", MODEL_FAMILIES)
def test_spec_head_dim_is_transformers(family, head_dim):
    """The one head_dim formula (``arch.adapters.head_dim``, read through the spec) against
    transformers' modules: the family's tiny config (llama, mistral, qwen2 derive hidden / heads;
    qwen3 and gemma3_text give it) and head_dim set to twice that; the decoder's model and KV
    layout use the same width."""
    from transformers import AutoModelForCausalLM

    from compress.decoder.model import Transformer

    config = models_config(family, **({} if head_dim is None else {"head_dim": head_dim}))
    spec = spec_of(config)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
        ours = Transformer(config)
    assert spec.head_dim == hf_head_dim(hf) == (head_dim or 16)  # hidden 64 / 4 heads
    attn = ours.model.layers[0].self_attn
    assert attn.head_dim == spec.head_dim == ours.kv_layout().head_dim
    assert attn.q_proj.out_features == spec.n_heads * spec.head_dim


def test_iam_pair_leaves_the_config_untouched(tmp_path):
    """IAM builds its mapped layers through the decoder's attention registry and the spec
    (``with_attention``): the loaded HF config is the folder's, with no iam attribute, and the
    spec of that config alone has no mapped layer."""
    from compress.decoder.model import ATTENTIONS, Transformer, register_attention
    from compress.io.checkpoint import read_config
    from compress.methods.iam.attention import KIND, MappedAttention, load_mapped
    from compress.methods.iam.decode import IAMModel
    from tests.test_decoder import save, tiny_hf, tiny_tokenizer

    tok = tiny_tokenizer()
    big = save(tiny_hf(num_hidden_layers=4), tmp_path / "big", tok)
    small = save(tiny_hf(num_hidden_layers=2), tmp_path / "small", tok)
    large, _ = load_mapped(big, [2, 3])
    little, _ = load(small)
    pair = IAMModel(large, little, {2: 1, 3: 0}, {2: [0, 1, 0, 1], 3: [1, 0, 1, 0]})
    for model, folder in ((large, big), (little, small)):
        assert not [k for k in vars(model.config) if "iam" in k.lower() or "mapped" in k]
        assert model.config.to_dict() == read_config(folder)[0].to_dict()
    assert [ls.attention for ls in large.spec.layers] == ["gqa", "gqa", KIND, KIND]
    assert all(ls.attention == "gqa" for ls in spec_of(large.config).layers)
    assert isinstance(large.model.layers[3].self_attn, MappedAttention)
    assert pair.spec is large.spec and ATTENTIONS[KIND] is MappedAttention
    with pytest.raises(CompressError, match="not loaded as mapped layers"):
        IAMModel(little, little, {1: 0}, {1: [0, 1, 2, 3]})
    # a kind nobody registered, a built-in kind, a layer the model does not have
    with pytest.raises(CompressError, match="nothing registered"), torch.device("meta"):
        Transformer(read_config(big)[0], {0: "nonesuch"})
    with pytest.raises(CompressError, match="decoder's own"):
        register_attention("gqa", MappedAttention)
    with pytest.raises(CompressError, match="layers 0..3"):
        large.spec.with_attention({4: KIND})

"""``eval/bench/moe_decode.py`` at the tests' size: the int4 OLMoE folder it makes is a stock
compressed-tensors checkpoint that transformers loads and our decoder holds in 4 bits, and its
GGUF holds the same weights (the script compares every Q4_0 tensor, dequantized by the ``gguf``
package, with the folder's weights and exits non-zero on any difference)."""

import json
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM

from compress.decoder.experts import QuantExperts
from compress.decoder.generate import static_step
from compress.decoder.kv import new_cache
from compress.decoder.model import load
from compress.io.checkpoint import load_state
from compress.kernels import w4a8_cpu
from tests.conftest import run_bench


def test_moe_bench_folder_and_gguf(tmp_path):
    res = run_bench("moe_decode", "--out", tmp_path, "--tiny", "--skip-bench", timeout=900)
    folder = tmp_path / "olmoe-int4"
    cfg = json.loads((folder / "config.json").read_text())
    n = cfg["num_hidden_layers"] * (4 + 3 * cfg["num_experts"])  # every quantized linear
    assert (
        f"GGUF dequantized (gguf package) = the folder's weights | exact, {n} linears" in res.stdout
    )
    lines = [line for line in res.stdout.splitlines() if "llama.cpp vs ours" in line]
    if lines:  # llama.cpp installed (the bench extra): its logits are our model's
        assert float(lines[0].split("|")[2]) < 0.05, res.stdout
    assert cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] == 32
    ours, _ = load(folder)
    sparse = [b.mlp.experts for b in ours.model.layers]
    assert all(isinstance(x, QuantExperts) for x in sparse)  # the experts stay 4-bit
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()  # no flags
    for p in hf.parameters():
        if p.is_floating_point():
            p.data = p.data.float()
    ids = torch.randint(3, cfg["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = ours(ids, new_cache(ours, "full", 1, ids.shape[1]))[0].double()
        want = hf(ids).logits[0].double()
    assert ((got - want).norm() / want.norm()).item() < 1e-3
    # the W4A8 kernel (the decoder's default): 4 rows x top-2 are decode's regime, where all the
    # routed experts of a layer run in one call; it computes what each expert's own W4A8
    # layers compute, and stays within int8 activations' error of transformers
    fast, _ = load(folder, kernel="w4a8")
    short = ids[:, :4]
    with torch.no_grad():
        one_call = fast(short, new_cache(fast, "full", 1, 4))[0].double()
        experts = [b.mlp.experts for b in fast.model.layers]
        assert all(isinstance(x.fused, w4a8_cpu.Experts) for x in experts)  # it ran
        for x in experts:
            x.fused = False  # each routed expert through its own layers instead
        per_expert = fast(short, new_cache(fast, "full", 1, 4))[0].double()
    assert ((one_call - per_expert).norm() / per_expert.norm()).item() < 1e-5
    assert ((one_call - want[:4]).norm() / want[:4].norm()).item() < 2e-2
    # the compiled decode step holds those experts as one op in its graph (no graph break):
    # teacher-forced steps after a prefill, against the eager forward over the same tokens
    for x in experts:
        x.fused = None
    step, cache = static_step(fast, "full", None, 1, 16)
    with torch.no_grad():
        out = [fast(ids[:, :10], cache)[:, -1:]]
        out += [step(ids[:, t : t + 1], cache) for t in range(10, 15)]
        eager = fast(ids[:, :15], new_cache(fast, "full", 1, 15))[:, 9:]
    assert step.compiled_calls == 5
    static = [b.mlp.experts for b in step.model.model.layers]
    assert all(isinstance(x, w4a8_cpu.W4A8Experts) for x in static)
    assert ((torch.cat(out, 1) - eager).norm() / eager.norm()).item() < 1e-5
    # batch-invariant serving (kernel_every_m): the one-call kernel at every M (9 rows x top-2
    # routed slots, past the 8 experts), and each row's output is what it is alone, bit for bit
    w4a8_cpu.use(fast, "w4a8", every_m=True)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, cfg["hidden_size"], generator=gen)
    e = torch.stack([torch.randperm(cfg["num_experts"], generator=gen)[:2] for _ in range(9)])
    w = torch.rand(9, 2, generator=gen)
    moe = fast.model.layers[0].mlp.experts
    moe.fused = None
    with torch.no_grad():
        together = moe(x, w, e)
        assert isinstance(moe.fused, w4a8_cpu.Experts)
        alone = torch.cat([moe(x[i : i + 1], w[i : i + 1], e[i : i + 1]) for i in range(9)])
    assert torch.equal(together, alone)
    # the same folder with every quantized layer split across two shards (codes in the first,
    # scales and shapes in the second): each layer is decoded once it is whole, the same model
    split = tmp_path / "split"
    split.mkdir()
    stored = {}
    for f in sorted(folder.glob("*.safetensors")):
        stored.update(load_file(f))
    second = {k: t for k, t in stored.items() if k.endswith((".weight_scale", ".weight_shape"))}
    first = {k: t for k, t in stored.items() if k not in second}
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for name, part in zip(names, (first, second)):
        save_file(part, str(split / name))
    weight_map = {k: names[k in second] for k in stored}
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (split / "model.safetensors.index.json").write_text(json.dumps(index))
    (split / "config.json").write_text((folder / "config.json").read_text())
    again, _ = load(split)
    with torch.no_grad():
        assert torch.equal(again(ids, new_cache(again, "full", 1, ids.shape[1]))[0].double(), got)


def test_load_state_drops_each_tensor_once_copied():
    """The checkpoint's dict and the model are never both whole in memory."""
    layer = nn.Linear(8, 4)
    layer.config = SimpleNamespace()  # what load_state reads of a model's config (ties)
    tensors = {"weight": torch.randn(4, 8), "bias": torch.randn(4)}
    want = {k: t.clone() for k, t in tensors.items()}
    load_state(layer, tensors, "here")
    assert tensors == {} and all(torch.equal(getattr(layer, k), t) for k, t in want.items())

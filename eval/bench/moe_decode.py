"""Batch-1 decode of an OLMoE-1B-7B-shaped int4 model: ours against llama.cpp on the same weights.

    python eval/bench/moe_decode.py --out DIR [--rounds 3] [--new 64] [--threads 2] [--tiny]

Random weights (no MoE ships offline), made as int4 directly and never as floats:

1. ``DIR/olmoe-int4``: a stock OLMoE folder (``OlmoeConfig``: 16 layers, hidden 2048, 16 heads,
   64 experts of width 1024, top-8, vocabulary 50304) in the compressed-tensors format
   (``compress.formats.compressed_tensors``), every linear but the router and the head symmetric
   INT4 in groups of 32, one tensor per expert, one shard per layer. The packed words are drawn
   as uniform 32-bit integers (so every code is uniform on [0, 16)), the fp16 scales uniform on
   [0.002, 0.006]; the embedding, head, router and norms are fp16. It is written by a child
   process, one layer in memory at a time, whose peak RSS the table gives against the folder's
   bytes (bar: under 1.5x).
2. ``DIR/olmoe-q4_0.gguf``: the same weights for llama.cpp, written with the ``gguf`` package.
   A symmetric INT4 group of 32 is exactly a Q4_0 block (ggml's ``block_q4_0``: fp16 ``d``, then
   16 bytes whose byte j holds element j in its low nibble and element j + 16 in its high one,
   ``x = (nibble - 8) d``): the stored codes ``q + 8`` and fp16 scales are copied, not requantized.
   The head is written as Q8_0 (llama.cpp's int8 groups of 32, from the same fp16 head), as our
   decoder's default quantizes it to int8 at load; the embedding as F16, router and norms F32.
3. A check that both hold the same model: the next-token logits of one prompt from llama.cpp
   and from our decoder (exact kernel, fp32), ``||a - b|| / ||b||`` (two unrelated
   models' logits of equal norm give about sqrt(2)).
4. ``eval/bench/bench_decode.py --int4 DIR/olmoe-int4 --gguf DIR/olmoe-q4_0.gguf --systems
   ours-int4-default llama.cpp``: batch-1 decode tok/s, peak RSS, the bytes a decode step reads
   (the experts counted at top-k / experts: the routed ones) and that rate's share of the
   measured copy bandwidth, in one run, rounds alternating.

``--tiny`` makes a 2-layer model of the same kinds (the tests' size); ``--skip-bench`` stops
after step 3.
"""

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from compress.formats import compressed_tensors as ct

GROUP = 32  # ggml's Q4_0 / Q8_0 block
ATTN = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output"}  # ours -> llama.cpp's
SHAPES = {
    "full": dict(
        hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, vocab_size=50304,
    ),
    "tiny": dict(
        hidden_size=256, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, vocab_size=512,
    ),
}  # fmt: skip


def olmoe_config(size: str) -> dict:
    """config.json of the OLMoE-shaped model, quantization_config included."""
    from transformers import OlmoeConfig

    cfg = OlmoeConfig(
        **SHAPES[size],
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        norm_topk_prob=False,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    ).to_dict()
    cfg["architectures"] = ["OlmoeForCausalLM"]
    cfg["torch_dtype"] = "float16"
    cfg["quantization_config"] = ct.quantization_config(
        4, GROUP, symmetric=True, ignore=("lm_head", r"re:.*mlp\.gate$")
    )
    return cfg


def linears(cfg: dict, layer: int) -> list[tuple[str, int, int]]:
    """``(name, out, in)`` of one layer's quantized linears, in the checkpoint's names."""
    H, inter = cfg["hidden_size"], cfg["intermediate_size"]
    p = f"model.layers.{layer}"
    out = [(f"{p}.self_attn.{n}_proj", H, H) for n in ATTN]
    for e in range(cfg["num_experts"]):
        q = f"{p}.mlp.experts.{e}"
        out += [
            (f"{q}.gate_proj", inter, H),
            (f"{q}.up_proj", inter, H),
            (f"{q}.down_proj", H, inter),
        ]
    return out


def random_int4(rows: int, k: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One symmetric INT4 layer's compressed-tensors tensors: uniform packed words (so uniform
    codes) and fp16 scales uniform on [0.002, 0.006]."""
    words = torch.randint(-(2**31), 2**31, (rows, k * 4 // 32), generator=gen, dtype=torch.int64)
    scales = torch.rand(rows, k // GROUP, generator=gen) * 0.004 + 0.002
    return {
        "weight_packed": words.to(torch.int32),
        "weight_scale": scales.half(),
        "weight_shape": torch.tensor([rows, k], dtype=torch.int64),
    }


def build(folder: Path, size: str, seed: int = 0) -> int:
    """Write the int4 folder (module docstring, step 1); returns its weight bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = olmoe_config(size)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = torch.Generator().manual_seed(seed)
    H, V, E = cfg["hidden_size"], cfg["vocab_size"], cfg["num_experts"]

    def normal(*shape, std=0.02):
        return (torch.randn(*shape, generator=gen) * std).half()

    def norm(n):
        return (1 + torch.randn(n, generator=gen) * 0.1).half()

    index, total = {}, 0
    shards = [("embed", None)] + [(f"layer{i}", i) for i in range(cfg["num_hidden_layers"])]
    for shard, layer in shards:
        if layer is None:
            tensors = {
                "model.embed_tokens.weight": normal(V, H),
                "lm_head.weight": normal(V, H),
                "model.norm.weight": norm(H),
            }
        else:
            p = f"model.layers.{layer}"
            tensors = {
                f"{p}.input_layernorm.weight": norm(H),
                f"{p}.post_attention_layernorm.weight": norm(H),
                f"{p}.self_attn.q_norm.weight": norm(H),
                f"{p}.self_attn.k_norm.weight": norm(H),
                f"{p}.mlp.gate.weight": normal(E, H),
            }
            for name, rows, k in linears(cfg, layer):
                tensors.update({f"{name}.{n}": t for n, t in random_int4(rows, k, gen).items()})
        name = f"model-{shard}.safetensors"
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        index.update(dict.fromkeys(tensors, name))
        del tensors
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=1)
    )
    return total


def q4_0(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Q4_0 blocks (uint8 ``[rows, in/32 * 18]``) of one symmetric INT4 layer: compressed-tensors
    ``weight_packed`` (int32 ``[rows, in/8]``, code j of a row in bits 4j..4j+3 of the row's
    little-endian bit string, stored as q + 8) and fp16 ``weight_scale`` ``[rows, in/32]``."""
    rows = packed.shape[0]
    b = packed.astype("<i4").view(np.uint8).reshape(rows, -1)  # byte i: codes 2i (low), 2i + 1
    u = np.stack([b & 15, b >> 4], -1).reshape(rows, -1, GROUP)  # [rows, blocks, 32] codes
    qs = u[..., :16] | (u[..., 16:] << 4)
    d = scales.astype("<f2").view(np.uint8).reshape(rows, -1, 2)
    return np.concatenate([d, qs], -1).reshape(rows, -1)


def write_gguf(folder: Path, path: Path) -> int:
    """The folder's weights as a Q4_0 GGUF (module docstring, step 2); returns its bytes."""
    import gguf

    cfg = json.loads((folder / "config.json").read_text())
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    H, E, L = cfg["hidden_size"], cfg["num_experts"], cfg["num_hidden_layers"]
    Q40, Q80 = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q8_0

    def read(name: str) -> torch.Tensor:
        with safe_open(str(folder / index[name]), "pt") as f:
            return f.get_tensor(name)

    def int4(name: str) -> np.ndarray:
        return q4_0(read(f"{name}.weight_packed").numpy(), read(f"{name}.weight_scale").numpy())

    def f32(name: str) -> np.ndarray:
        return read(name).float().numpy()

    plan = [  # (gguf name, how to make it)
        ("token_embd.weight", lambda: read("model.embed_tokens.weight").numpy()),
        ("output_norm.weight", lambda: f32("model.norm.weight")),
        ("output.weight", lambda: gguf.quants.quantize(f32("lm_head.weight"), Q80)),
    ]
    for i in range(L):
        p = f"model.layers.{i}"
        plan += [
            (f"blk.{i}.attn_norm.weight", lambda p=p: f32(f"{p}.input_layernorm.weight")),
            (f"blk.{i}.ffn_norm.weight", lambda p=p: f32(f"{p}.post_attention_layernorm.weight")),
            (f"blk.{i}.attn_q_norm.weight", lambda p=p: f32(f"{p}.self_attn.q_norm.weight")),
            (f"blk.{i}.attn_k_norm.weight", lambda p=p: f32(f"{p}.self_attn.k_norm.weight")),
            (f"blk.{i}.ffn_gate_inp.weight", lambda p=p: f32(f"{p}.mlp.gate.weight")),
        ]
        for ours, theirs in ATTN.items():
            plan.append(
                (f"blk.{i}.{theirs}.weight", lambda n=f"{p}.self_attn.{ours}_proj": int4(n))
            )
        for part in ("gate", "up", "down"):  # the experts of one projection stacked, [E, rows, .]
            plan.append(
                (
                    f"blk.{i}.ffn_{part}_exps.weight",
                    lambda p=p, part=part: np.stack(
                        [int4(f"{p}.mlp.experts.{e}.{part}_proj") for e in range(E)]
                    ),
                )
            )

    w = gguf.GGUFWriter(str(path), "olmoe")
    w.add_name("olmoe-int4-random")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(H)
    w.add_block_count(L)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(float(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(E)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    V = cfg["vocab_size"]  # a SentencePiece-style vocabulary of placeholders: ids are fed directly
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"t{i}" for i in range(V - len(tokens))]
    types = [2, 3, 3] + [6] * 256 + [1] * (V - 259)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * V)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)

    shapes = {  # the arrays' shapes and dtypes, without making them
        "token_embd.weight": ((V, H), np.float16, None),
        "output_norm.weight": ((H,), np.float32, None),
        "output.weight": ((V, H // GROUP * 34), np.uint8, Q80),
    }

    def shape_of(name: str):
        if name in shapes:
            return shapes[name]
        if name.endswith("norm.weight"):
            return (H,), np.float32, None
        if name.endswith("ffn_gate_inp.weight"):
            return (E, H), np.float32, None
        inter = cfg["intermediate_size"]
        k = inter if "down" in name else H
        rows = H if ("down" in name or "attn" in name) else inter
        shape = (rows, k // GROUP * 18)
        return ((E, *shape) if "_exps" in name else shape), np.uint8, Q40

    for name, _ in plan:
        shape, dtype, raw = shape_of(name)
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        w.add_tensor_info(name, shape, np.dtype(dtype), nbytes, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, make in plan:
        arr = make()
        if arr.shape != shape_of(name)[0]:
            raise SystemExit(f"{name}: made {arr.shape}, declared {shape_of(name)[0]}")
        w.write_tensor_data(np.ascontiguousarray(arr))
        del arr
    w.close()
    return path.stat().st_size


def check_codes(folder: Path, gguf_path: Path, layers) -> int:
    """Every quantized tensor of ``layers`` in the GGUF, dequantized by the ``gguf`` package
    (ggml's reference), equals the folder's weight dequantized by compressed-tensors' layout,
    exactly; returns how many linears were compared (raises SystemExit otherwise)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    cfg = json.loads((folder / "config.json").read_text())
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {t.name: t for t in GGUFReader(str(gguf_path)).tensors}
    n = 0
    for layer in layers:
        for name, _, _ in linears(cfg, layer):
            part = name.split(".")[-1].removesuffix("_proj")
            if ".experts." in name:
                e = int(name.split(".")[-2])
                t = tensors[f"blk.{layer}.ffn_{part}_exps.weight"]
            else:
                e, t = None, tensors[f"blk.{layer}.{ATTN[part]}.weight"]
            theirs = dequantize(t.data[e] if e is not None else t.data, t.tensor_type)
            with safe_open(str(folder / index[f"{name}.weight_packed"]), "pt") as f:
                local = {
                    k: f.get_tensor(f"{name}.{k}") for k in ct.NAMES if k != "weight_zero_point"
                }
            ours = ct.dequantize(local, 4, GROUP, True).numpy()
            if not np.array_equal(theirs, ours):
                raise SystemExit(f"{name}: the GGUF's Q4_0 blocks do not hold the folder's codes")
            n += 1
    return n


def same_model(folder: Path, gguf_path: Path, threads: int) -> float:
    """``||llama.cpp - ours|| / ||ours||`` of the next-token logits after one prompt (ours: the
    exact kernel in fp32, so only llama.cpp's int8 activations and Q8_0 head differ)."""
    import llama_cpp

    from compress.decoder.kv import new_cache
    from compress.decoder.model import load

    cfg = json.loads((folder / "config.json").read_text())
    ids = torch.randint(3, cfg["vocab_size"], (12,), generator=torch.Generator().manual_seed(1))
    llm = llama_cpp.Llama(
        str(gguf_path), n_threads=threads, n_ctx=64, logits_all=True, verbose=False
    )
    llm.eval(ids.tolist())
    theirs = torch.tensor(np.asarray(llm.scores[len(ids) - 1]), dtype=torch.float64)
    del llm
    model, _ = load(folder, dtype=torch.float32)
    with torch.no_grad():
        ours = model(ids[None], new_cache(model, "full", 1, len(ids)), last=True)[0, -1].double()
    return float((theirs - ours).norm() / ours.norm())


def child(args) -> None:
    """``--child build``: make the folder and print its bytes (the parent reads this process's
    peak RSS)."""
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the interpreter, torch
    total = build(Path(args.out) / "olmoe-int4", "tiny" if args.tiny else "full")
    print(json.dumps({"bytes": total, "base_rss": base}))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="where the folder and the GGUF are written")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model (the tests' size)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-bench", action="store_true", help="stop after the logits check")
    ap.add_argument("--child", choices=["build"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args)
    out = Path(args.out)
    folder, gguf_path = out / "olmoe-int4", out / "olmoe-q4_0.gguf"
    rows = {}

    t = time.perf_counter()
    cmd = [sys.executable, __file__, "--out", str(out), "--child", "build"]
    got = subprocess.run(cmd + (["--tiny"] if args.tiny else []), capture_output=True, text=True)
    if got.returncode:
        raise SystemExit(got.stderr)
    made = json.loads(got.stdout.strip().splitlines()[-1])
    size, base = made["bytes"], made["base_rss"]
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    rows["int4 folder"] = f"{size / 2**30:.3f} GiB, written in {time.perf_counter() - t:.0f} s"
    rows["builder's peak RSS"] = (
        f"{rss / 2**30:.3f} GiB = {rss / size:.3f}x the folder (bar < 1.5x); "
        f"{base / 2**30:.3f} GiB of it before the first tensor (Python, torch)"
    )

    t = time.perf_counter()
    g = write_gguf(folder, gguf_path)
    rows["Q4_0 GGUF"] = f"{g / 2**30:.3f} GiB, written in {time.perf_counter() - t:.0f} s"
    L = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    n = check_codes(folder, gguf_path, range(L) if args.tiny else (0, L - 1))
    rows["GGUF dequantized (gguf package) = the folder's weights"] = f"exact, {n} linears"
    try:
        import llama_cpp  # noqa: F401  (the bench extra)
    except ImportError:
        rows["llama.cpp"] = (
            "not installed (pip install llama-cpp-python): no logits check, no bench"
        )
        args.skip_bench = True
    else:
        rel = same_model(folder, gguf_path, args.threads)
        rows["next-token logits, llama.cpp vs ours (rel.)"] = f"{rel:.4f}"
    print("| what | figure |\n|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v} |")
    if args.skip_bench:
        return
    bench = Path(__file__).with_name("bench_decode.py")
    cmd = [sys.executable, str(bench), "--int4", str(folder), "--gguf", str(gguf_path)]
    cmd += ["--systems", "ours-int4-default", "llama.cpp", "--rounds", str(args.rounds)]
    cmd += ["--new", str(args.new), "--threads", str(args.threads), "--no-prefill"]
    subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()

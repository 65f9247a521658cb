"""How much of a dequantized GGUF's weights still lie on a 4-bit grid, per group size: the reason
to compare methods at group 64 or more on the embedded models, never 32.

``python eval/bench/gguf_grid.py [--model gemma3-270m] [--layers 0 5] [--blocks 2000]``

For each linear weight of the chosen layers and each group size g (along the input dimension,
as the group-wise quantizers group), a group is *on a 4-bit grid* when its distinct values are
``v_0 + k * step`` for integers ``0 <= k <= 15`` (``step``: their smallest gap). GGUF's own type
of each tensor (read with the ``gguf`` package) is printed beside it, with RTN INT4's relative
error ``||W_hat - W|| / ||W||`` at each g (``compress.formats.quantizer.fake_quantize``). A
Q4_1/Q4_K tensor is on the grid at 32 and not beyond; a method with a scale or clip search can
land on that grid at 32 and look better than it would on continuous weights.
"""

import argparse
import json

import torch

GROUPS = (32, 64, 128)
GGUF_NAMES = {  # HF module -> llama.cpp tensor name
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def on_grid(w: torch.Tensor, group: int, blocks: int, levels: int = 16) -> float:
    """The fraction of the first ``blocks`` groups of ``w`` that lie on a ``levels``-level grid."""
    rows = w.double().reshape(-1, group)[:blocks]
    ok = 0
    for row in rows:
        u = torch.unique(row)
        if len(u) > levels:
            continue
        if len(u) < 2:
            ok += 1
            continue
        k = (u - u[0]) / (u[1:] - u[:-1]).min()
        ok += bool((k - k.round()).abs().max() < 1e-3 and k.max().round() <= levels - 1)
    return ok / len(rows)


def main(argv=None) -> None:
    from gguf import GGUFReader
    from safetensors import safe_open

    from compress.formats.quantizer import fake_quantize
    from compress.io.source import convert_embedded, embedded_gguf

    p = argparse.ArgumentParser(prog="python eval/bench/gguf_grid.py")
    p.add_argument(
        "--model", default="gemma3-270m", help="an embedded model (compress.io.embedded)"
    )
    p.add_argument("--layers", type=int, nargs="+", default=[0, 5])
    p.add_argument("--blocks", type=int, default=2000, help="groups checked per tensor")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    folder = convert_embedded(args.model)
    types = {t.name: t.tensor_type.name for t in GGUFReader(embedded_gguf(args.model)).tensors}
    rows = []
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        for layer in args.layers:
            for module, gguf_name in GGUF_NAMES.items():
                w = f.get_tensor(f"model.layers.{layer}.{module}.weight")
                gguf_type = types.get(f"blk.{layer}.{gguf_name}.weight")
                row = {"tensor": f"{layer}.{module}", "gguf": gguf_type}
                for g in GROUPS:
                    if w.shape[1] % g:
                        continue
                    row[f"grid@{g}"] = round(on_grid(w, g, args.blocks), 3)
                    row[f"rtn4@{g}"] = float(((fake_quantize(w, 4, g) - w).norm() / w.norm()))
                rows.append(row)
                shown = (
                    f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
                )
                print("  ".join(shown))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()

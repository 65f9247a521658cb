"""The GPU checks of GPTQ and the rotation stage: the same computation on ``--device`` as on the
CPU, and the time of one GPTQ linear at a real shape. Prints a table; runs on the CPU too
(``--device cpu --small``), which is how the suite smoke-tests it.

    python eval/bench/gpu_check.py                  # on a CUDA GPU
    python eval/bench/gpu_check.py --device cpu --small
"""

import argparse
import time
from types import SimpleNamespace

import torch

from compress.methods.quant.gptq import Hessian, gptq, gptq_quantize
from compress.methods.quant.rotate import rotate_model


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def correlated(n: int, d: int, gen) -> torch.Tensor:
    """Calibration-like inputs: low rank plus noise, a few outlier channels."""
    x = torch.randn(n, d // 8, generator=gen) @ torch.randn(d // 8, d, generator=gen)
    x = x + 0.1 * torch.randn(n, d, generator=gen)
    x[:, :4] *= 10
    return x


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def check_linear(device, d_in: int, d_out: int, bits: int, act_order: bool) -> dict:
    """One linear: Hessian and GPTQ on ``device`` against the CPU."""
    gen = torch.Generator().manual_seed(0)
    x, w = correlated(4 * d_in, d_in, gen), torch.randn(d_out, d_in, generator=gen) * 0.02
    hs = {}
    for dev in ("cpu", device):
        h = Hessian(d_in, dev)
        for chunk in x.split(max(1, x.shape[0] // 4)):
            h.add(chunk.to(dev))
        hs[dev] = h.value()
    ref_h = 2 * x.double().T @ x.double() / x.shape[0]
    out = {"hessian_rel": rel(hs[device].cpu(), ref_h)}
    t0 = time.perf_counter()
    q_cpu = gptq_quantize(w, hs["cpu"], bits, 128, act_order=act_order)
    out["gptq_cpu_s"] = time.perf_counter() - t0
    sync(device)
    t0 = time.perf_counter()
    q_dev = gptq_quantize(w.to(device), hs[device], bits, 128, act_order=act_order)
    sync(device)
    out["gptq_s"] = time.perf_counter() - t0
    out["codes_equal"] = (q_dev.q.cpu() == q_cpu.q).float().mean().item()
    out["weights_rel"] = rel(q_dev.dequantize().cpu(), q_cpu.dequantize())
    xs = x[:256]
    out["out_err"] = rel(xs @ q_dev.dequantize().cpu().T, xs @ w.T)
    out["out_err_cpu"] = rel(xs @ q_cpu.dequantize().T, xs @ w.T)
    return out


def tiny_llama(seed: int = 0):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, vocab_size=512, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return model


class Config(SimpleNamespace):
    """A recipe's keys as attributes, and ``get`` as a DictConfig has (no omegaconf needed)."""

    def get(self, key, default=None):
        return getattr(self, key, default)


def check_stage(device) -> dict:
    """The gptq stage on a tiny Llama, calibrated on ``device`` and on the CPU: GPTQ's rounding
    decisions follow float32 sums, so a different order of summation flips a few codes and the
    error compensation carries the flip on; the two models' logits agree closely, not exactly."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 512, (4, 64), generator=gen)
    cfg = Config(
        gptq=Config(
            bits=4, group_size=64, damp=0.01, block_size=128, act_order=True,
            true_sequential=True, batch=2,
        )
    )  # fmt: skip
    models = {}
    for dev in ("cpu", device):
        ctx = SimpleNamespace(cfg=cfg, calibration=lambda: tokens, record={}, device=dev)
        models[dev] = gptq(tiny_llama(), ctx)
    ids = tokens[:2, :32]
    with torch.no_grad():
        a, b = models["cpu"](ids).logits, models[device](ids).logits
    return {"stage_logits_rel": rel(b, a)}


def check_rotation(device) -> dict:
    """The rotation on ``device`` keeps the logits (float64)."""
    model = tiny_llama().double()
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(ids).logits
        model = rotate_model(model.to(device), seed=0)
        out = model(ids.to(device)).logits.cpu()
    return {"rotation_logits_rel": rel(out, ref)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="CPU-sized shapes (the suite's smoke run)")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("error: no CUDA GPU is visible; use --device cpu --small on the CPU.")
    torch.backends.cuda.matmul.allow_tf32 = False
    shapes = [(256, 128)] if args.small else [(2048, 2048), (4096, 4096), (4096, 11008)]
    print(
        f"device {args.device}"
        + (f" ({torch.cuda.get_device_name()})" if "cuda" in args.device else "")
    )
    print(
        "| in x out | bits | act_order | H rel vs fp64 | codes = CPU | W rel vs CPU | out err | CPU's | GPTQ s | CPU's |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for d_in, d_out in shapes:
        for bits, act in ((4, False), (4, True), (3, True)):
            r = check_linear(args.device, d_in, d_out, bits, act)
            print(
                f"| {d_in} x {d_out} | {bits} | {act} | {r['hessian_rel']:.1e} | "
                f"{r['codes_equal']:.4f} | {r['weights_rel']:.1e} | {r['out_err']:.4f} | {r['out_err_cpu']:.4f} | "
                f"{r['gptq_s']:.3f} | {r['gptq_cpu_s']:.3f} |"
            )
    for name, value in {**check_stage(args.device), **check_rotation(args.device)}.items():
        print(f"{name}: {value:.2e}")


if __name__ == "__main__":
    main()

"""The Triton kernels on a CUDA GPU: relative error against float64 math, and time against the
dense fp16 product of the same shape (``triton.testing.do_bench``, microseconds).

    python eval/bench/bench_triton.py
"""

import torch

from compress.formats.quantizer import quantize
from compress.kernels import packkv_pv, packkv_qk, packkv_ref, quant_matmul
from compress.layers import QuantLinear


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit(
            "error: bench_triton times the Triton kernels on a CUDA GPU, and none is visible."
        )
    from triton.testing import do_bench

    torch.manual_seed(0)
    print("quant_matmul (Triton) vs x @ W_hat in float64; time vs dense fp16 x @ W^T, K=N=4096")
    for bits in (4, 3, 8):
        w = torch.randn(4096, 4096) * 0.02
        layer = QuantLinear.from_quantized(quantize(w, bits, 128)).cuda()
        what = layer.dequantize(torch.float64)
        dense = what.half()
        for m in (1, 16, 512):
            x = torch.randn(m, 4096, device="cuda", dtype=torch.float16)
            y = quant_matmul(x, layer)
            err = rel(y, x.double() @ what.t())
            tq = do_bench(lambda: quant_matmul(x, layer))
            td = do_bench(lambda: x @ dense.t())
            print(
                f"int{bits} M={m:4d}: rel err {err:.1e}  triton {tq * 1e3:7.1f} us  "
                f"dense fp16 {td * 1e3:7.1f} us  ratio {td / tq:.2f}x"
            )

    print("PackKV qk/pv (Triton) vs float64 on the dequantized cache; time vs fp16 q@K^T, p@V")
    for n in (1408, 7872):
        BH, D, M = 3, 64, 3
        k = torch.randn(BH, n, D, device="cuda")
        v = torch.randn(BH, n, D, device="cuda")
        packs = []
        for x, rel_ in ((k, 0.04), (v, 0.1)):
            codes, tmin, lstep = packkv_ref.quantize_tokens(x, rel_)
            p = packkv_ref.Packed.empty(BH, n, D, packkv_ref.max_code(rel_), x.device)
            p.append(codes.long(), tmin, lstep)
            packs.append(p)
        q = torch.randn(BH, M, D, device="cuda")
        kh, vh = (packkv_ref.dequantize(p).double() for p in packs)
        s = packkv_qk(q, packs[0])
        pr = torch.softmax(torch.randn(BH, M, n, device="cuda"), -1)
        o = packkv_pv(pr, packs[1])
        k16, v16 = k.half(), v.half()
        tqk = do_bench(lambda: packkv_qk(q, packs[0]))
        tpv = do_bench(lambda: packkv_pv(pr, packs[1]))
        tfp = do_bench(lambda: (q.half() @ k16.transpose(1, 2), pr.half() @ v16))
        print(
            f"n={n}: qk rel err {rel(s, q.double() @ kh.transpose(1, 2)):.1e}, pv rel err "
            f"{rel(o, pr.double() @ vh):.1e}; qk {tqk * 1e3:.1f} us + pv {tpv * 1e3:.1f} us vs fp16 both "
            f"{tfp * 1e3:.1f} us"
        )


if __name__ == "__main__":
    main()

"""The accuracy cost of a kernel that is not bit-faithful (``decode.kernel=w4a8``): the
evaluation run again with the quantized layers computing through it.

``compress.kernels.w4a8_cpu`` rounds each quantized layer's input to int8 per token and 32
channels (``compress.kernels.w4a8_ref`` has the arithmetic), so its logits differ from the exact
weight-only path of the main evaluation. On the same windows it reports::

    kernel              the kernel measured (w4a8)
    kernel_ppl          perplexity through it
    kernel_ppl_cost     kernel_ppl / ppl - 1, against the exact path's ppl of the same run
    kernel_kl_vs_source KL(source || model through the kernel), nats per token (when the source
                        is compared)

and, when the recipe keeps the head as stored, the same for the decoder's whole default (the
kernel with the head quantized to ``default_head``, ``compress.decoder.runtime``)::

    default_head, default_ppl, default_ppl_cost, default_kl_vs_source

The decoder's fast default computes with the kernel only while ``kernel_ppl_cost`` stays within
``BAR`` on the 40-window protocol.
"""

from compress.eval.perplexity import evaluate
from compress.kernels.w4a8_cpu import use

BAR = 0.003  # the largest ppl cost the decoder's default accepts (0.3%)


def kernel_figures(
    model, windows, reference, kernel: str, exact: dict, prefix: str = "kernel", **eval_kw
) -> dict:
    """The figures above for ``model`` (its quantized layers switched to ``kernel``, then back),
    ``exact`` being the main evaluation's figures, named ``{prefix}_ppl`` and so on."""
    if kernel == "exact":
        return {}
    layers = use(model, kernel, every_m=True)  # every window token as a decode step computes it
    try:
        desc = f"eval ({kernel})" if prefix == "kernel" else f"eval ({prefix})"
        figures = evaluate(model, windows, reference, desc=desc, **eval_kw)
    finally:
        use(model, "exact")
    out = {
        "kernel": kernel,
        f"{prefix}_layers": layers,
        f"{prefix}_ppl": figures["ppl"],
        f"{prefix}_ppl_cost": figures["ppl"] / exact["ppl"] - 1,
        f"{prefix}_within_bar": figures["ppl"] / exact["ppl"] - 1 <= BAR,
    }
    if "kl_vs_source" in figures:
        out[f"{prefix}_kl_vs_source"] = figures["kl_vs_source"]
    return out

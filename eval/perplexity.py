"""Perplexity, KL(source || compressed) and top-1 agreement on the same windows.

For each window x of ``seqlen`` tokens, with p = softmax of the source's
logits and q = softmax of the compressed model's, over the ``seqlen - 1``
predicted positions t::

    ppl  = exp( mean_t  -log q(x_{t+1} | x_<=t) )          source_ppl: the same with p
    KL   = mean_t  sum_v p_t(v) (log p_t(v) - log q_t(v))
    top1 = mean_t  [argmax p_t == argmax q_t]

Means run over every predicted token of every window.

With ``cache`` set to a folder, the source's log-probs of each window are kept
there (fp32 safetensors, ~400 MB a window of 2048 for a 49k vocabulary), keyed
by the source's sha256 and the window's tokens, so that comparing many recipes
runs the source once.
"""

import hashlib
import math
import os
from pathlib import Path

import torch
from tqdm import tqdm


def _log_probs(model, window: torch.Tensor) -> torch.Tensor:
    """Log-probs ``[seqlen - 1, V]`` on the CPU; the model runs on whatever device it is on."""
    device = next(model.parameters()).device
    logits = model(window.unsqueeze(0).to(device)).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1).cpu()


def _source_log_probs(
    source, window: torch.Tensor, cache: Path | None, source_sha: str
) -> torch.Tensor:
    if cache is None:
        return _log_probs(source, window)
    from safetensors.torch import load_file, save_file

    key = hashlib.sha256(source_sha.encode() + window.numpy().tobytes()).hexdigest()[:32]
    path = Path(cache) / f"{key}.safetensors"
    if path.exists():
        return load_file(str(path))["log_probs"]
    lp = _log_probs(source, window)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # concurrent runs may fill the same entry
    save_file({"log_probs": lp.contiguous()}, str(tmp))
    tmp.replace(path)
    return lp


@torch.no_grad()
def evaluate(
    model,
    windows: torch.Tensor,
    source=None,
    desc: str = "eval",
    cache: Path | None = None,
    source_sha: str = "",
) -> dict:
    """Figures of ``model`` on ``windows [n, seqlen]``; KL and top-1 against ``source`` if given."""
    nll, source_nll, kl, agree, count = 0.0, 0.0, 0.0, 0, 0
    for window in tqdm(windows, desc=desc, unit="window"):
        lq = _log_probs(model, window)
        target = window[1:]
        nll += -lq.gather(1, target.unsqueeze(1)).sum().item()
        if source is not None:
            lp = _source_log_probs(source, window, cache, source_sha)
            source_nll += -lp.gather(1, target.unsqueeze(1)).sum().item()
            kl += (lp.exp() * (lp - lq)).sum().item()
            agree += (lp.argmax(-1) == lq.argmax(-1)).sum().item()
            del lp
        count += target.numel()
        del lq
    out = {
        "ppl": math.exp(nll / count),
        "ppl_windows": int(windows.shape[0]),
        "seqlen": int(windows.shape[1]),
        "tokens": count,
    }
    if source is not None:
        out["source_ppl"] = math.exp(source_nll / count)
        out["kl_vs_source"] = kl / count
        out["top1_vs_source"] = agree / count
    return out

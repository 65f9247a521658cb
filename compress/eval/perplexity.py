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

When either model is disk-backed (``compress.io.offload``: its decoder layers read one at a time),
the windows go through it layer by layer (``final_hidden``) and the log-probs are made
``chunk`` tokens at a time (``head_log_probs``), so ``[seqlen, V]`` float32 arrays exist for a
chunk of tokens only; a cached source reads its log-probs a chunk at a time from the file, and
fills a missing entry a chunk at a time. The figures are the same sums.
"""

import hashlib
import math
import os
from pathlib import Path

import torch
from tqdm import tqdm

from compress.io.offload import final_hidden, head_log_probs, is_lazy
from compress.io.shards import TensorStream


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

    path = _cache_path(cache, source_sha, window)
    if path.exists():
        return load_file(str(path))["log_probs"]
    lp = _log_probs(source, window)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # concurrent runs may fill the same entry
    save_file({"log_probs": lp.contiguous()}, str(tmp))
    tmp.replace(path)
    return lp


def _cache_path(cache, source_sha: str, window: torch.Tensor) -> Path:
    key = hashlib.sha256(source_sha.encode() + window.numpy().tobytes()).hexdigest()[:32]
    return Path(cache) / f"{key}.safetensors"


def _windows_at_once(seqlen: int, hidden: int, budget: int = 2**28) -> int:
    """How many windows' hidden states ``final_hidden`` carries through a layer together."""
    return max(1, budget // (seqlen * hidden * 4))


def _chunk_tokens(vocab: int, budget: int = 2**27) -> int:
    """Tokens of ``[tokens, vocab]`` float32 log-probs within ``budget`` bytes; each chunk reads
    the whole head, so a large vocabulary wants chunks of more tokens (BENCHMARKS.md)."""
    return max(16, budget // (vocab * 4))


class _Side:
    """One model's log-probs on the windows, chunk by chunk: a whole model runs a window at once;
    a disk-backed one runs a group of windows through its layers, then its head a chunk at a
    time."""

    def __init__(self, model, windows: torch.Tensor, device):

        self.model, self.windows, self.device = model, windows, device
        self.lazy = is_lazy(model)
        self.group = _windows_at_once(windows.shape[1], model.config.hidden_size)
        self.hidden, self.start, self.full, self.full_at = None, -1, None, -1

    def chunk(self, w: int, a: int, b: int) -> torch.Tensor:
        """Log-probs ``[b - a, V]`` of window ``w``'s positions ``a..b-1`` (CPU, float32)."""
        if not self.lazy:
            if self.full_at != w:
                self.full, self.full_at = None, w
                self.full = _log_probs(self.model, self.windows[w])
            return self.full[a:b]

        if self.hidden is None or not self.start <= w < self.start + self.group:
            self.hidden = None
            self.start = w - w % self.group
            group = self.windows[self.start : self.start + self.group]
            self.hidden = final_hidden(self.model, group, self.device)
        h = self.hidden[w - self.start, a:b].to(self.device)
        return head_log_probs(self.model, h).cpu()


@torch.no_grad()
def _evaluate_chunked(model, windows, source, desc, cache, source_sha, device) -> dict:
    from safetensors import safe_open

    ours = _Side(model, windows, device)
    theirs = _Side(source, windows, device) if source is not None else None
    step = _chunk_tokens(model.config.vocab_size)
    nll, source_nll, kl, agree, count = 0.0, 0.0, 0.0, 0, 0
    n = windows.shape[1] - 1
    for w, window in enumerate(tqdm(windows, desc=desc, unit="window")):
        target = window[1:]
        path = _cache_path(cache, source_sha, window) if source is not None and cache else None
        cached = (
            safe_open(str(path), framework="pt") if path is not None and path.exists() else None
        )
        stream = None
        if path is not None and cached is None:
            stream = TensorStream(path, "log_probs", (n, model.config.vocab_size), torch.float32)
        try:
            for a in range(0, n, step):
                b = min(n, a + step)
                lq = ours.chunk(w, a, b)
                t = target[a:b].unsqueeze(1)
                nll += -lq.gather(1, t).sum().item()
                if theirs is not None:
                    if cached is not None:
                        lp = cached.get_slice("log_probs")[a:b]
                    else:
                        lp = theirs.chunk(w, a, b)
                        if stream is not None:
                            stream.write(lp)
                    source_nll += -lp.gather(1, t).sum().item()
                    kl += (lp.exp() * (lp - lq)).sum().item()
                    agree += (lp.argmax(-1) == lq.argmax(-1)).sum().item()
                    del lp
                del lq
        finally:
            if stream is not None:
                stream.close()
            del cached
        count += target.numel()
    return _figures(windows, count, nll, source is not None, source_nll, kl, agree)


def _figures(windows, count, nll, compared, source_nll, kl, agree) -> dict:
    out = {
        "ppl": math.exp(nll / count),
        "ppl_windows": int(windows.shape[0]),
        "seqlen": int(windows.shape[1]),
        "tokens": count,
    }
    if compared:
        out["source_ppl"] = math.exp(source_nll / count)
        out["kl_vs_source"] = kl / count
        out["top1_vs_source"] = agree / count
    return out


@torch.no_grad()
def evaluate(
    model,
    windows: torch.Tensor,
    source=None,
    desc: str = "eval",
    cache: Path | None = None,
    source_sha: str = "",
    device=None,
) -> dict:
    """Figures of ``model`` on ``windows [n, seqlen]``; KL and top-1 against ``source`` if given.

    ``device``: where a disk-backed model's layers run (default the CPU); a whole model runs
    where it is."""

    if is_lazy(model) or is_lazy(source):
        device = torch.device(device or "cpu")
        return _evaluate_chunked(model, windows, source, desc, cache, source_sha, device)
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
    return _figures(windows, count, nll, source is not None, source_nll, kl, agree)

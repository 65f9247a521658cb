"""Perplexity, KL(source || compressed) and top-1 agreement on the same windows.

For each window x of ``seqlen`` tokens, with p = softmax of the source's
logits and q = softmax of the compressed model's, over the ``seqlen - 1``
predicted positions t::

    ppl  = exp( mean_t  -log q(x_{t+1} | x_<=t) )          source_ppl: the same with p
    KL   = mean_t  sum_v p_t(v) (log p_t(v) - log q_t(v))
    top1 = mean_t  [argmax p_t == argmax q_t]

Means run over every predicted token of every window.

With ``cache`` set to a folder, what the source adds to each window's figures is kept there,
keyed by the source's sha256 and the window's tokens, so that comparing many recipes runs the
source once. When the compressed model's head is a float linear map (W, b; no final softcap),
log q = W h + b - lse(W h + b) at its final hidden state h, so::

    sum_v p(v) log q(v) = h . (W^T p) + b . p - lse sum_v p(v),    lse = W_y . h + b_y - log q(y)

for any token y (the next token), and an entry, keyed by W and b as well, keeps per position
only ``sum_v p log p``, ``sum_v p``, ``W^T p`` (hidden floats), ``b . p``, ``argmax p`` and
``log p(x_{t+1})``, in float64 (``lse`` multiplies ``sum_v p``, 1 to the rounding of the
float32 log-probs): 4.6 kB a position for a 576-wide model, against 197 kB of float32 log-probs
over a 49k vocabulary (1 MB over Gemma 3's 262k). Recipes that keep the head as stored share
one entry. Otherwise (a quantized or capped head) an entry keeps the log-probs.

A model runs a window at once and its log-probs are read a chunk of positions at a time; a
disk-backed one (``compress.io.offload``: its decoder layers read one at a time) runs a group
of windows through its layers (``final_hidden``) and makes its log-probs ``chunk`` tokens at a
time (``head_log_probs``), so ``[seqlen, V]`` float32 arrays exist for a chunk of tokens only.
The figures are the same sums.
"""

import hashlib
import math
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm import tqdm

from compress.arch.adapters import get_adapter
from compress.errors import CompressError
from compress.io.offload import final_hidden, head_log_probs, is_lazy
from compress.io.shards import TensorStream

SUMMARY = ("negent", "mass", "row", "bias", "argmax", "target")


def _log_probs(model, window: torch.Tensor) -> torch.Tensor:
    """Log-probs ``[seqlen - 1, V]`` on the CPU; the model runs on whatever device it is on."""
    return _whole(model, window)[0]


def _whole(model, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log-probs [seqlen - 1, V], final hidden [seqlen - 1, hidden])``, float32 on the CPU,
    of a model run whole on ``window``; the hidden states are the final norm's output."""
    device = next(model.parameters()).device
    kept = []
    try:
        norm = model.get_submodule(get_adapter(model.config).final_norm)
        hook = norm.register_forward_hook(lambda _m, _i, out: kept.append(out))
    except AttributeError:  # no final norm by the adapter's name: no hidden states
        hook = None
    try:
        logits = model(window.unsqueeze(0).to(device)).logits[0, :-1].float()
    finally:
        if hook is not None:
            hook.remove()
    hidden = kept[-1][0, :-1].float().cpu() if kept else None
    return torch.log_softmax(logits, dim=-1).cpu(), hidden


def _cache_path(cache, source_sha: str, window: torch.Tensor, kind: str = "") -> Path:
    key = hashlib.sha256(source_sha.encode() + window.numpy().tobytes()).hexdigest()[:32]
    return Path(cache) / f"{key}{'.' + kind if kind else ''}.safetensors"


def _windows_at_once(seqlen: int, hidden: int, budget: int = 2**28) -> int:
    """How many windows' hidden states ``final_hidden`` carries through a layer together."""
    return max(1, budget // (seqlen * hidden * 4))


def _chunk_tokens(vocab: int, budget: int = 2**27) -> int:
    """Tokens of ``[tokens, vocab]`` float32 log-probs within ``budget`` bytes; each chunk reads
    the whole head, so a large vocabulary wants chunks of more tokens (BENCHMARKS.md)."""
    return max(16, budget // (vocab * 4))


class _Side:
    """One model's log-probs and final hidden states on the windows, chunk by chunk: a whole
    model runs a window at once; a disk-backed one runs a group of windows through its layers,
    then its head a chunk at a time."""

    def __init__(self, model, windows: torch.Tensor, device):
        self.model, self.windows, self.device = model, windows, device
        self.lazy = is_lazy(model)
        self.group = _windows_at_once(windows.shape[1], model.config.hidden_size)
        self.hidden, self.start, self.full, self.full_at = None, -1, None, -1

    def chunk(self, w: int, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs ``[b - a, V]`` and hidden states ``[b - a, hidden]`` of window ``w``'s
        positions ``a..b-1`` (CPU, float32)."""
        if not self.lazy:
            if self.full_at != w:
                self.full, self.full_at = None, w
                self.full = _whole(self.model, self.windows[w])
            lp, h = self.full
            return lp[a:b], None if h is None else h[a:b]

        if self.hidden is None or not self.start <= w < self.start + self.group:
            self.hidden = None
            self.start = w - w % self.group
            group = self.windows[self.start : self.start + self.group]
            self.hidden = final_hidden(self.model, group, self.device)
        h = self.hidden[w - self.start, a:b]
        return head_log_probs(self.model, h.to(self.device)).cpu(), h


def linear_head(model) -> nn.Linear | None:
    """The model's head when its logits are exactly ``h W^T + b`` in float32, else None."""
    if getattr(model.config, "final_logit_softcapping", None) is not None:
        return None
    adapter = get_adapter(model.config)
    try:
        model.get_submodule(adapter.final_norm)  # where the hidden states are read
        head = model.get_submodule(adapter.lm_head)
    except AttributeError:
        return None
    if type(head) is not nn.Linear or head.weight.is_meta:
        return None
    if head.weight.dtype != torch.float32 and not is_lazy(model):  # lazy heads widen to float32
        return None
    return head


def _head_sha(head: nn.Linear) -> str:
    h = hashlib.sha256()
    for t in (head.weight, head.bias):
        if t is not None:
            t = t.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.view(torch.uint8).numpy())
    return h.hexdigest()


def _summary(lp: torch.Tensor, target: torch.Tensor, head: nn.Linear, rows: int = 16384) -> dict:
    """What the source's log-probs ``lp [t, V]`` add to the figures, per position, for the
    compressed model's ``head`` (the module docstring): ``sum_v p log p``, ``sum_v p``,
    ``W^T p``, ``b . p``, ``argmax p``, ``log p(target)``."""
    w = head.weight
    p32 = lp.exp()  # the p of every sum below: sum_v p is 1 to its rounding, and lse multiplies it
    row = torch.zeros(lp.shape[0], w.shape[1], dtype=torch.float64)
    for v in range(0, w.shape[0], rows):
        chunk = w[v : v + rows].detach().to(torch.float32)
        row += (p32[:, v : v + rows].to(chunk.device) @ chunk).cpu()
    p = p32.double()
    bias = (
        p @ head.bias.detach().double().cpu()
        if head.bias is not None
        else torch.zeros(lp.shape[0], dtype=torch.float64)
    )
    return {
        "negent": (p * lp.double()).sum(-1),
        "mass": p.sum(-1),  # 1 to float32's rounding of lp, which lse would multiply
        "row": row,
        "bias": bias,
        "argmax": lp.argmax(-1),
        "target": lp.gather(1, target.unsqueeze(1))[:, 0].double(),
    }


def _against_summary(s: dict, lq, hq, target, head: nn.Linear) -> tuple[float, int]:
    """``(sum_t KL_t, agreements)`` of the compressed model's log-probs ``lq [t, V]`` at its
    hidden states ``hq [t, hidden]`` against a source summary (the module docstring)."""
    w = head.weight
    hd = hq.double()

    def lse(tokens):  # lse(W h + b) from one token's logit and log-prob
        logit = (hd * w[tokens.to(w.device)].detach().cpu().double()).sum(-1)
        if head.bias is not None:
            logit += head.bias.detach().cpu().double()[tokens]
        return logit - lq.gather(1, tokens.unsqueeze(1))[:, 0].double()

    top = lq.argmax(-1)
    by_target, by_top = lse(target), lse(top)
    if not torch.allclose(by_target, by_top, rtol=1e-4, atol=1e-3):
        raise CompressError(
            "evaluation: the model's logits are not its head's linear map of its final norm's "
            "output, so the cached source summary cannot be used; run with "
            "eval.cache_logprobs=false."
        )
    cross = (hd * s["row"]).sum(-1) + s["bias"] - by_target * s["mass"]  # sum_v p log q
    return (s["negent"] - cross).sum().item(), int((s["argmax"] == top).sum())


def _read_summary(path: Path, n: int, hidden: int) -> dict | None:
    if not path.exists():
        return None
    try:
        s = load_file(str(path))
    except Exception:  # a damaged entry is made again
        return None
    if set(s) != set(SUMMARY) or s["row"].shape != (n, hidden):
        return None
    return s


def _write_summary(path: Path, parts: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # concurrent runs may fill the same entry
    save_file({k: torch.cat([p[k] for p in parts]).contiguous() for k in SUMMARY}, str(tmp))
    tmp.replace(path)


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
    device = torch.device(device or "cpu")
    ours = _Side(model, windows, device)
    theirs = _Side(source, windows, device) if source is not None else None
    cache = cache if source is not None else None
    head = linear_head(model) if cache is not None else None
    key = f"{source_sha}:{_head_sha(head)}" if head is not None else source_sha
    step = _chunk_tokens(model.config.vocab_size)
    nll, source_nll, kl, agree, count = 0.0, 0.0, 0.0, 0, 0
    n = windows.shape[1] - 1
    for w, window in enumerate(tqdm(windows, desc=desc, unit="window")):
        target = window[1:]
        summary = stored = stream = parts = path = None
        if head is not None:
            path = _cache_path(cache, key, window, "summary")
            summary = _read_summary(path, n, head.weight.shape[1])
            parts = [] if summary is None else None
        elif cache is not None:
            path = _cache_path(cache, source_sha, window)
            if path.exists():
                stored = safe_open(str(path), framework="pt")
        try:
            for a in range(0, n, step):
                b = min(n, a + step)
                lq, hq = ours.chunk(w, a, b)
                t = target[a:b]
                nll += -lq.gather(1, t.unsqueeze(1)).sum().item()
                if source is None:
                    continue
                if summary is not None:
                    part = {k: v[a:b] for k, v in summary.items()}
                    source_nll += -part["target"].sum().item()
                    k, g = _against_summary(part, lq, hq, t, head)
                    kl, agree = kl + k, agree + g
                    continue
                if stored is not None:
                    lp = stored.get_slice("log_probs")[a:b]
                else:
                    lp = theirs.chunk(w, a, b)[0]
                if cache is not None and head is None and stored is None:
                    if stream is None:  # the log-probs' own width (a padded head's too)
                        stream = TensorStream(path, "log_probs", (n, lp.shape[1]), torch.float32)
                    stream.write(lp)
                if parts is not None:
                    parts.append(_summary(lp, t, head))
                source_nll += -lp.gather(1, t.unsqueeze(1)).sum().item()
                kl += (lp.exp() * (lp - lq)).sum().item()
                agree += (lp.argmax(-1) == lq.argmax(-1)).sum().item()
                del lp
        finally:
            if stream is not None:
                stream.close()
            del stored
        if parts:
            _write_summary(path, parts)
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

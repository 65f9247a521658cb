"""The ``--device`` a user names, checked before anything loads: ``cpu``, ``cuda`` or
``cuda:N`` on a machine with that GPU (``mps`` where torch has it)."""

from compress.errors import CompressError


def check_device(name: str, flag: str = "--device") -> str:
    """``name`` as torch spells it, or a ``CompressError`` naming what this machine has."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        device = None
    have = ["cpu"]
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        have += ["cuda"] + [f"cuda:{i}" for i in range(n)]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        have.append("mps")
    ok = device is not None and (
        device.type == "cpu"
        or (
            device.type == "cuda"
            and torch.cuda.is_available()
            and (device.index is None or device.index < torch.cuda.device_count())
        )
        or (device.type == "mps" and "mps" in have)
    )
    if not ok:
        why = (
            "this machine has no GPU that torch can use"
            if device is not None and device.type == "cuda" and not torch.cuda.is_available()
            else "this machine has no such device"
            if device is not None
            else "torch knows no such device"
        )
        raise CompressError(
            f"{flag} {name}: {why}. Use one of: {', '.join(have)} (leave {flag} out to take the "
            f"GPU when there is one, else the CPU)."
        )
    return str(device)

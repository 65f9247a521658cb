"""Our bit-plane layout of integer codes: defined in ``compress.kernels.bitplanes`` (the kernels
own the bit layouts; the formats read them from there)."""

from compress.kernels.bitplanes import (  # noqa: F401
    check_codes,
    pack_planes,
    pack_words,
    plane_widths,
    unpack_planes,
    unpack_words,
)

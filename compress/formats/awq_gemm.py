"""AutoAWQ's GEMM layout of INT4 codes: defined in ``compress.kernels.awq_gemm`` (the kernels own
the bit layouts; the formats read them from there)."""

from compress.kernels.awq_gemm import AWQ_ORDER, AWQ_REVERSE_ORDER, pack_awq, unpack_awq  # noqa: F401

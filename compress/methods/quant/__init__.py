"""Quantization: primitives (quantizer, packing), the packed layer, and the methods (rtn, awq, llm_int8)."""

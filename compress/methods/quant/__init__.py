"""Quantization: primitives (quantizer, packing), the packed layer, and the methods (rtn, awq, gptq, llm_int8)."""

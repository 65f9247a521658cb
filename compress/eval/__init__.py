"""Evaluation: perplexity/KL/top-1, per-run reports, benchmarks (scripts)."""

"""Benchmark and sweep scripts, ``python -m compress.eval.bench.NAME``; the pipeline never imports
them (the library they measure is ``compress.eval``)."""

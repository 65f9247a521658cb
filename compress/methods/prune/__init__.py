"""Structured pruning (Minitron): activation importance, width and depth slicing, the pipeline stage."""

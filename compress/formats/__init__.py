"""Bit layouts and on-disk formats: how codes, scales and zeros are laid out in a checkpoint.

A leaf: the kernels read these layouts, the layers and the loader store them; nothing here
imports a kernel, a method or the runtime.
"""

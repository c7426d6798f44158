"""Triton device helpers for the NVFP4 format (private to ``moe_fp4.triton_kernels``)."""

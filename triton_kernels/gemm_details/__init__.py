"""Triton kernels behind :mod:`moe_fp4.triton_kernels.gemm` (private)."""

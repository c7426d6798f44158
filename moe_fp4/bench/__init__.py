"""Benchmarks of moe_fp4: timing, roofline, peers and reports behind ``moe-fp4 bench``.

Modules (each importable without a GPU; only :mod:`.timing`'s GPU timer, the ceiling
measurements and the peers need one at run time):

* :mod:`.shapes`   the benchmarked MoE layers and token counts.
* :mod:`.roofline` the floor of one MoE forward (weight bytes, FLOPs, measured ceilings), row metrics.
* :mod:`.timing`   CUDA-graph replay timing with a cold L2, and the measured ceilings.
* :mod:`.checks`   the comparators and tolerances every timed output must pass.
* :mod:`.peers`    vLLM's Marlin NVFP4 MoE and the bf16 grouped-GEMM MoE from the peer kit.
* :mod:`.workload` weights, per-M inputs and the timed paths (whole forwards, and stages through
                   ``run_pipeline``).
* :mod:`.engine`   the benchmark loop that produces a report (a JSON-ready dict).
* :mod:`.report`   JSON, Markdown, PNG and terminal writers of a report.
* :mod:`.cli`      the ``moe-fp4 bench`` subcommand.
* :mod:`.hostcost` ``fused_moe``'s host path on the CPU with every launch stubbed (host-cost timing,
                   launch records).
"""

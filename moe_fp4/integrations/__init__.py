"""Integrations of moe_fp4 with other libraries, each imported on its own and only when used.

* :mod:`moe_fp4.integrations.transformers`: NVFP4 Qwen3-MoE checkpoints in Hugging Face
  transformers (>= 5), the experts running in :func:`moe_fp4.fused_moe`.
* :mod:`moe_fp4.integrations.generate`: greedy generation from a checkpoint folder
  (the ``moe-fp4 generate`` command).

Nothing here imports transformers at import time.
"""

__all__: list[str] = []

"""``moe-fp4 generate PATH --prompt TEXT``: greedy generation (:mod:`moe_fp4.integrations.generate`)."""

from ..integrations.generate import add_arguments
from ..integrations.generate import run_cli as run

__all__ = ["add_arguments", "run"]

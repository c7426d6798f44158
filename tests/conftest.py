"""Shared pytest configuration: hardware markers and the Triton CPU interpreter switch."""

from __future__ import annotations

import os

import pytest
import torch

# On a machine without a GPU the Triton kernels run in Triton's CPU interpreter. The switch
# must be set before any @triton.jit function is created, i.e. before test modules import
# the kernels; conftest.py is imported first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_GPU = torch.cuda.is_available()
CAPABILITY = torch.cuda.get_device_capability() if HAS_GPU else None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (none here)"))
        elif "sm90" in item.keywords and (CAPABILITY is None or CAPABILITY[0] != 9):
            item.add_marker(pytest.mark.skip(reason=f"needs compute capability 9.x, this is {CAPABILITY}"))
        elif "blackwell" in item.keywords and (CAPABILITY is None or CAPABILITY[0] not in (10, 11, 12)):
            item.add_marker(
                pytest.mark.skip(reason="needs an SM100/SM120 GPU; none is available to this project")
            )


@pytest.fixture
def device() -> torch.device:
    """The CUDA device when there is one, else the CPU."""
    return torch.device("cuda") if HAS_GPU else torch.device("cpu")

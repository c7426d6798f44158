"""The Qwen3-MoE router: softmax, top-k, optional renormalisation, against numpy in float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_fp4.checkpoint import Router, route


def softmax64(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits - logits.max(axis=1, keepdims=True))
    return z / z.sum(axis=1, keepdims=True)


def numpy_route(logits: np.ndarray, top_k: int, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """float64 softmax over the rows, the top_k largest (descending), optionally rescaled to sum 1."""
    p = softmax64(logits)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :top_k]
    w = np.take_along_axis(p, ids, axis=1)
    if renormalize:
        w = w / w.sum(axis=1, keepdims=True)
    return w, ids


def inputs(m: int, e: int, h: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, h, generator=g)).to(dtype), (torch.randn(e, h, generator=g) / h**0.5).to(dtype)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("m, e, top_k", [
    (33, 8, 2),     # the tiny checkpoints' router
    (5, 128, 8),    # Qwen3-30B-A3B: 128 experts, top-8
    (4, 7, 7),      # top_k == E: every expert, sorted
    (1, 3, 1),      # one token, top-1
])
def test_route_against_numpy(m, e, top_k, renormalize):
    x, w = inputs(m, e, 64)
    weights, ids = route(x, w, top_k, renormalize=renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (m, top_k)
    # The contract fixes the logits as the hidden-state-dtype linear; the rest is checked
    # independently in float64. float32 softmax vs float64: ~1e-7 relative; 1e-6 bounds it.
    logits = torch.nn.functional.linear(x, w).double().numpy()
    want_w, _ = numpy_route(logits, top_k, renormalize)
    np.testing.assert_allclose(weights.numpy(), want_w, rtol=1e-6, atol=0)
    # bf16 logits tie often (8-bit mantissa) and the order among equal ones is free, so the
    # ids are checked by what they carry: distinct experts whose probabilities are the weights.
    chosen = np.take_along_axis(softmax64(logits), ids.long().numpy(), axis=1)
    if renormalize:
        chosen = chosen / chosen.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(chosen, want_w, rtol=1e-6, atol=0)
    assert all(len(set(row)) == top_k for row in ids.tolist())
    total = weights.sum(-1)
    if renormalize:
        torch.testing.assert_close(total, torch.ones(m), rtol=0, atol=1e-6)
    elif top_k < e:
        assert bool((total < 1).all())


def test_logits_are_rounded_to_the_hidden_state_dtype():
    # bf16 hidden states: the logits are a bf16 linear (as the model's nn.Linear computes
    # them), so a float32 router weight is cast to bf16 first.
    x, w = inputs(16, 8, 64)
    a = route(x, w.float(), 2, renormalize=False)
    b = route(x, w, 2, renormalize=False)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_router_object():
    x, w = inputs(6, 8, 32)
    r = Router(w, 2, True)
    assert r.num_experts == 8
    got, want = r(x), route(x, w, 2, renormalize=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("args, error, message", [
    ((torch.zeros(4, 32, dtype=torch.int32), torch.zeros(8, 32), 2, True), TypeError, "hidden_states: expected dtype"),
    ((torch.zeros(4, 32), torch.zeros(8, 32, 1), 2, True), ValueError, "gate_weight: expected a 2-D tensor"),
    ((torch.zeros(4, 32), torch.zeros(8, 16), 2, True), ValueError, r"hidden_states: expected shape \[M, 16\]"),
    ((torch.zeros(4, 32), torch.zeros(8, 32), 0, True), ValueError, r"top_k: expected an integer in \[1, 8\]"),
    ((torch.zeros(4, 32), torch.zeros(8, 32), 9, True), ValueError, r"top_k: expected an integer in \[1, 8\].*got 9"),
    ((torch.zeros(4, 32), torch.zeros(8, 32), True, True), ValueError, "top_k: expected an integer"),
    ((torch.zeros(4, 32), torch.zeros(8, 32), 2, 1), TypeError, "renormalize: expected a bool, got int"),
    (([[0.0] * 32], torch.zeros(8, 32), 2, True), TypeError, "hidden_states: expected a torch.Tensor, got list"),
])
def test_bad_router_input(args, error, message):
    x, w, k, renorm = args
    with pytest.raises(error, match=message):
        route(x, w, k, renormalize=renorm)


def test_bad_router_construction():
    with pytest.raises(ValueError, match=r"top_k: expected an integer in \[1, 4\]"):
        Router(torch.zeros(4, 8), 5, True)
    with pytest.raises(TypeError, match="gate_weight: expected dtype"):
        Router(torch.zeros(4, 8, dtype=torch.uint8), 2, True)

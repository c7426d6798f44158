"""The peers from the peer kit (``marlin_moe.py``, ``humming_moe.py``), built on moe_fp4's own weights.

* ``marlin``: vLLM 0.26.0's Marlin NVFP4 MoE (W4A16), what vLLM runs on Hopper for NVFP4
  checkpoints. Needs the kit's prepared op library (``--peer-lib``) and an sm_90 GPU.
* ``humming``: the Humming NVFP4 MoE (W4A16, WGMMA kernels JIT-compiled with NVRTC), vLLM 0.26.0's
  "humming" MoE backend. Needs the ``humming-kernels`` package importable, the Marlin op
  library (for ``moe_align_block_size``) and an sm_90 GPU.
* ``bf16``: the same weights dequantized to bf16 on ``torch._grouped_mm``.

The kit is imported at run time from its folder (``--peer-kit DIR``, else the folder of
``--peer-lib FILE``); none of its code lives in this repository. Both peers are called as
``peer(x, topk_weights, topk_ids, out=...)`` on the same tensors as moe_fp4.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch

from ..format import dequantize_nvfp4

__all__ = ["KIT_MODULE", "KNOWN_FAULTS", "PeerConfig", "build_peers", "known_fault", "load_kit"]

KIT_MODULE = "marlin_moe"
HUMMING_MODULE = "humming_moe"
_LOADED_NAME = "moe_fp4_peer_kit"
_HUMMING_NAME = "moe_fp4_peer_humming"


# Shapes where a peer's own kernels fault: an illegal address there ends the whole process (every
# later row and layer with it), so such a case is reported as not run, with the reason, instead
# of launched. (peer, E, topk, H, I, M) -> why. Each entry is reproduced by the peer kit's own
# command line, without moe_fp4 in the process.
KNOWN_FAULTS: dict[tuple[str, int, int, int, int, int], str] = {
    ("humming", 16, 1, 5120, 8192, 1024): (
        "humming-kernels 0.1.19 faults here (cudaErrorInvalidAddressSpace in its forward, whose GEMMs use "
        "80 x 256 x 64 and 72 x 256 x 64 stream-K blocks at this M; reproduced by the kit's `humming_moe.py "
        "--E 16 --H 5120 --I 8192 --topk 1 --M 1024` alone, tests/results/h200-2026-12-03-s14/call2); M = 4096 runs"),
}


def known_fault(peer: str, shape, M: int) -> str | None:
    """Why ``peer`` is not launched at this layer shape and M (a fault of its own), else None."""
    return KNOWN_FAULTS.get((peer, shape.E, shape.topk, shape.H, shape.I, M))


@dataclass(frozen=True)
class PeerConfig:
    """Where the peers come from: the kit's folder and the Marlin op library (either may be None)."""

    kit_dir: Path | None = None
    lib: Path | None = None

    @classmethod
    def from_args(cls, peer_kit: str | None, peer_lib: str | None) -> PeerConfig:
        lib = Path(peer_lib) if peer_lib else None
        kit = Path(peer_kit) if peer_kit else (lib.parent if lib is not None else None)
        return cls(kit, lib)


def load_kit(kit_dir: Path) -> ModuleType:
    """Import ``marlin_moe.py`` from ``kit_dir`` (once per process)."""
    return _load_module(kit_dir, KIT_MODULE, _LOADED_NAME)


def _load_module(kit_dir: Path, module: str, loaded_name: str) -> ModuleType:
    """Import ``module``.py from ``kit_dir`` as ``loaded_name`` (once per process)."""
    path = (Path(kit_dir) / f"{module}.py").resolve()
    loaded = sys.modules.get(loaded_name)
    if loaded is not None:
        if Path(loaded.__file__).resolve() != path:
            raise RuntimeError(f"--peer-kit: the kit was already imported from {loaded.__file__}; one process "
                               f"holds one kit (asked for {path})")
        return loaded
    if not path.is_file():
        raise FileNotFoundError(f"--peer-kit: expected the peer kit's {module}.py in {kit_dir}, found none "
                                f"(copy it there: cp ../shared/peers/{module}.py {kit_dir}/)")
    spec = importlib.util.spec_from_file_location(loaded_name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[loaded_name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[loaded_name]
        raise
    return mod


def _dequantized_bf16(experts) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w13 [E, 2I, H], w2 [E, H, I])`` in bf16, one expert at a time to bound the float32 temporaries."""
    E, H, I = experts.num_experts, experts.hidden_size, experts.intermediate_size
    gs = experts.w13_gs_per_half
    w13 = torch.empty((E, 2 * I, H), dtype=torch.bfloat16, device=experts.device)
    w2 = torch.empty((E, H, I), dtype=torch.bfloat16, device=experts.device)
    for e in range(E):
        for h, rows in enumerate((slice(0, I), slice(I, 2 * I))):
            w13[e, rows] = dequantize_nvfp4(experts.w13[e, rows], experts.w13_scale[e, rows], gs[e, h], torch.bfloat16)
        w2[e] = dequantize_nvfp4(experts.w2[e], experts.w2_scale[e], experts.w2_gs[e], torch.bfloat16)
    return w13, w2


@dataclass
class Peers:
    """The peers built for one layer: ``forwards[name]`` for those that can run, ``unavailable[name]`` = why not."""

    forwards: dict[str, object] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)
    library: dict | None = None


def build_peers(experts, config: PeerConfig) -> Peers:
    """Build the peers on ``experts``' NVFP4 tensors; what cannot be built is recorded, not raised."""
    peers = Peers()
    if config.kit_dir is None:
        why = "no peer kit given (--peer-lib FILE or --peer-kit DIR)"
        peers.unavailable.update(marlin=why, humming=why, bf16=why)
        return peers
    try:
        kit = load_kit(config.kit_dir)
    except Exception as exc:  # noqa: BLE001 - reported in the results, moe_fp4 is still timed
        why = f"peer kit not loadable: {type(exc).__name__}: {exc}"
        peers.unavailable.update(marlin=why, humming=why, bf16=why)
        return peers
    peers.forwards["bf16"] = kit.Bf16GroupedMoE(*_dequantized_bf16(experts))
    if experts.w13_gs.dim() == 2:
        peers.unavailable["marlin"] = "Marlin takes one global scale per expert for gate and up; these have two"
    elif config.lib is None:
        peers.unavailable["marlin"] = "no Marlin op library given (--peer-lib FILE)"
    elif experts.device.type != "cuda":
        peers.unavailable["marlin"] = f"Marlin runs on CUDA devices, not {experts.device.type}"
    else:
        try:
            ops = kit.load_marlin(config.lib)
            peers.forwards["marlin"] = kit.MarlinNvFp4MoE.from_nvfp4(
                experts.w13, experts.w13_scale, experts.w13_gs, experts.w2, experts.w2_scale, experts.w2_gs)
            peers.library = {"path": str(config.lib), "sha256": ops.sha256, "build": ops.build}
        except Exception as exc:  # noqa: BLE001 - reported in the results, the others are still timed
            peers.unavailable["marlin"] = f"{type(exc).__name__}: {exc}"
    if "marlin" not in peers.forwards:
        # Humming's MoE path aligns tokens with the Marlin library's moe_align_block_size op.
        peers.unavailable["humming"] = f"needs the Marlin peer's align op ({peers.unavailable['marlin']})"
    else:
        try:
            hum = _load_module(config.kit_dir, HUMMING_MODULE, _HUMMING_NAME)
            peers.forwards["humming"] = hum.HummingNvFp4MoE.from_nvfp4(
                experts.w13, experts.w13_scale, experts.w13_gs, experts.w2, experts.w2_scale, experts.w2_gs,
                align=ops.align)
        except Exception as exc:  # noqa: BLE001 - reported in the results, the others are still timed
            peers.unavailable["humming"] = f"{type(exc).__name__}: {exc}"
    return peers

"""Tensor lookup over a checkpoint folder's safetensors files, single-file or sharded.

Only the JSON headers are read when the store opens (names, dtypes, shapes), so a large
checkpoint is indexed in milliseconds; a tensor's bytes are read when :meth:`TensorStore.get`
asks for it. Dtypes are kept as safetensors writes them (``"U8"``, ``"F8_E4M3"``, ``"F32"``,
``"BF16"``, ...), which is what a user sees when inspecting the file.

The format is read directly (an 8-byte little-endian header length, a JSON header of
``{name: {dtype, shape, data_offsets}}``, then the little-endian data), so loading needs
nothing beyond torch.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["INDEX_FILE", "TORCH_DTYPES", "TensorInfo", "TensorStore"]

INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the JSON header
TORCH_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives (``nbytes`` from byte ``offset`` of ``file``) and what its header says."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _read_header(file: Path) -> dict[str, TensorInfo]:
    """Parse a safetensors header: ``{name: TensorInfo}`` (``__metadata__`` dropped)."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{file}: expected a safetensors file, got {size} bytes (too short for a header)")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER or 8 + n > size:
            raise ValueError(
                f"{file}: expected a safetensors file, got a header length of {n} bytes in a {size}-byte file"
            )
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{file}: expected a safetensors file, its JSON header does not parse ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file}: expected a safetensors header object, got {type(header).__name__}")
    out = {}
    data_size = size - 8 - n
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        ok = isinstance(entry, dict) and isinstance(entry.get("dtype"), str) and isinstance(entry.get("shape"), list)
        offsets = entry.get("data_offsets") if ok else None
        if not (ok and isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= data_size):
            raise ValueError(f"{file}: tensor {name!r} has a malformed header entry {entry!r} "
                             f"(data section of {data_size} bytes)")
        out[name] = TensorInfo(file, entry["dtype"], tuple(int(d) for d in entry["shape"]),
                               8 + n + offsets[0], offsets[1] - offsets[0])
    return out


class TensorStore:
    """Every tensor of the safetensors files of one folder, by name.

    With ``model.safetensors.index.json`` the index's ``weight_map`` decides which shard
    holds which tensor (each listed shard must exist and hold its tensors). Without an index,
    every ``*.safetensors`` file of the folder is read and a name may occur only once.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._info: dict[str, TensorInfo] = {}
        index = folder / INDEX_FILE
        if index.is_file():
            self._index_sharded(index)
        else:
            files = sorted(folder.glob("*.safetensors"))
            if not files:
                raise ValueError(
                    f"path: expected a checkpoint folder holding *.safetensors files, found none in {folder}"
                )
            for file in files:
                for name, info in _read_header(file).items():
                    if name in self._info:
                        raise ValueError(
                            f"{name}: stored twice, in {self._info[name].file.name} and {file.name}, and there is no "
                            f"{INDEX_FILE} to say which one counts"
                        )
                    self._info[name] = info

    def _index_sharded(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (json.JSONDecodeError, AttributeError) as exc:
            raise ValueError(
                f"{index}: expected a JSON object with a 'weight_map', got unparsable content ({exc})"
            ) from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: expected a non-empty 'weight_map' object, got {type(weight_map).__name__}")
        headers: dict[str, dict[str, TensorInfo]] = {}
        for name, shard in weight_map.items():
            if shard not in headers:
                file = self.folder / shard
                if not file.is_file():
                    raise ValueError(
                        f"{index.name}: tensor {name!r} is mapped to shard {shard!r}, "
                        f"which does not exist in {self.folder}"
                    )
                headers[shard] = _read_header(file)
            if name not in headers[shard]:
                raise ValueError(
                    f"{index.name}: tensor {name!r} is mapped to shard {shard!r}, whose header does not hold it"
                )
            self._info[name] = headers[shard][name]

    # ------------------------------------------------------------------ lookup
    def __contains__(self, name: str) -> bool:
        return name in self._info

    def names(self) -> list[str]:
        return list(self._info)

    def info(self, name: str) -> TensorInfo:
        if name not in self._info:
            raise ValueError(f"{name}: expected this tensor in the checkpoint {self.folder}, it is missing")
        return self._info[name]

    def get(self, name: str) -> torch.Tensor:
        """The tensor's data, on the CPU."""
        info = self.info(name)
        if info.dtype not in TORCH_DTYPES:
            raise TypeError(f"{name}: dtype {info.dtype} is not one moe_fp4 reads ({', '.join(TORCH_DTYPES)})")
        dtype = TORCH_DTYPES[info.dtype]
        numel = 1
        for d in info.shape:
            numel *= d
        if numel * dtype.itemsize != info.nbytes:
            raise ValueError(f"{name}: the header gives shape {list(info.shape)} of {info.dtype} "
                             f"({numel * dtype.itemsize} bytes) but {info.nbytes} bytes of data in {info.file.name}")
        with open(info.file, "rb") as f:
            f.seek(info.offset)
            data = bytearray(f.read(info.nbytes))
        if not data:
            return torch.empty(info.shape, dtype=dtype)
        return torch.frombuffer(data, dtype=dtype).reshape(info.shape)

"""Tensor lookup over a checkpoint folder's safetensors files, single-file or sharded.

The files are read with the safetensors library (``safe_open``, ``framework="pt"``). Opening
a file reads only its header (names, dtypes, shapes), so a large checkpoint is indexed in
milliseconds; a tensor's bytes are read when :meth:`TensorStore.get` asks for it. Dtypes are
kept as safetensors writes them (``"U8"``, ``"F8_E4M3"``, ``"F32"``, ``"BF16"``, ...), which
is what a user sees when inspecting the file.

The safetensors format: an 8-byte little-endian header length ``n``, a JSON header of ``n``
bytes (``{name: {dtype, shape, data_offsets}}`` and an optional ``__metadata__`` of strings),
then the data section, which the tensors cover back to back, each with exactly
``prod(shape) * itemsize`` bytes. A file that breaks a rule raises ``ValueError`` naming the
file and the header field at fault.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

__all__ = ["INDEX_FILE", "TORCH_DTYPES", "TensorInfo", "TensorStore"]

INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's limit on the JSON header
TORCH_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class TensorInfo:
    """The header of one tensor: the ``file`` holding it, its safetensors ``dtype`` and ``shape``."""

    file: Path
    dtype: str
    shape: tuple[int, ...]


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry_problem(entry: object, data_size: int, unknown_dtype: str | None) -> str | None:
    """What is wrong with one tensor's header entry on its own, or None."""
    if not isinstance(entry, dict):
        return f"has the header entry {entry!r}; expected an object with dtype, shape and data_offsets"
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype == unknown_dtype:
        return f"has dtype {dtype!r}, which is not a safetensors dtype"
    if not (isinstance(shape, list) and all(map(_is_count, shape))):
        return f"has shape {shape!r}; expected a list of non-negative integers"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))
            and offsets[0] <= offsets[1]):
        return f"has data_offsets {offsets!r}; expected [begin, end] with 0 <= begin <= end"
    if offsets[1] > data_size:
        return (f"has data_offsets {offsets}, past the end of the data section ({data_size} bytes): "
                "the file is truncated or the offsets are wrong")
    nbytes = offsets[1] - offsets[0]
    if dtype in TORCH_DTYPES and math.prod(shape) * TORCH_DTYPES[dtype].itemsize != nbytes:
        return (f"has shape {shape} of {dtype} ({math.prod(shape) * TORCH_DTYPES[dtype].itemsize} bytes) "
                f"but data_offsets {offsets} ({nbytes} bytes)")
    return None


def _explain(file: Path, exc: Exception) -> str:
    """Why the safetensors library refuses ``file``: the first rule of the format it breaks.

    The library's own messages do not always name the tensor, so the header is read again
    here, for this message only; when no rule below is broken, the library's message is given.
    """
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{file}: expected a safetensors file, got {size} bytes (too short for a header)"
        n = int.from_bytes(head, "little")
        if n > _MAX_HEADER or 8 + n > size:
            return f"{file}: expected a safetensors file, got a header length of {n} bytes in a {size}-byte file"
        text = f.read(n)
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        return f"{file}: expected a safetensors file, its JSON header does not parse ({err})"
    if not isinstance(header, dict):
        return f"{file}: expected a safetensors header object, got {type(header).__name__}"
    meta = header.pop("__metadata__", {})
    if not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        return f"{file}: expected __metadata__ to map names to strings, got {meta!r}"
    data_size = size - 8 - n
    unknown = re.search(r"unknown variant `([^`]*)`", str(exc))
    for name, entry in header.items():
        problem = _entry_problem(entry, data_size, unknown[1] if unknown else None)
        if problem:
            return f"{file}: tensor {name!r} {problem}"
    end, previous = 0, None
    for (begin, stop), name in sorted((entry["data_offsets"], name) for name, entry in header.items()):
        if begin != end:
            after = f"tensor {previous!r} ends at byte {end}" if previous else "the data section starts at byte 0"
            return (f"{file}: tensor {name!r} has data_offsets [{begin}, {stop}] but {after}; "
                    "tensors must cover the data section back to back, without gaps or overlaps")
        end, previous = stop, name
    if end != data_size:
        return (f"{file}: the tensors cover {end} bytes of the {data_size}-byte data section; "
                f"the last {data_size - end} bytes belong to no tensor")
    return f"{file}: expected a safetensors file, the safetensors library refuses it ({exc})"


class TensorStore:
    """Every tensor of the safetensors files of one folder, by name.

    With ``model.safetensors.index.json`` the index's ``weight_map`` decides which shard
    holds which tensor (each listed shard must exist and hold its tensors). Without an index,
    every ``*.safetensors`` file of the folder is read and a name may occur only once. Each
    file stays open (memory-mapped) while the store lives.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._info: dict[str, TensorInfo] = {}
        self._files: dict[Path, safe_open] = {}
        index = folder / INDEX_FILE
        if index.is_file():
            self._index_sharded(index)
            return
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"path: expected a checkpoint folder holding *.safetensors files, found none in {folder}")
        for file in files:
            for name, info in self._open(file).items():
                if name in self._info:
                    raise ValueError(
                        f"{name}: stored twice, in {self._info[name].file.name} and {file.name}, and there is no "
                        f"{INDEX_FILE} to say which one counts"
                    )
                self._info[name] = info

    def _open(self, file: Path) -> dict[str, TensorInfo]:
        """Open ``file`` and read its header: ``{name: TensorInfo}``."""
        try:
            handle = safe_open(file, framework="pt")
        except SafetensorError as exc:
            raise ValueError(_explain(file, exc)) from None
        self._files[file] = handle
        out = {}
        for name in handle.keys():  # noqa: SIM118 - a safe_open handle is not iterable
            header = handle.get_slice(name)
            out[name] = TensorInfo(file, header.get_dtype(), tuple(header.get_shape()))
        return out

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
                headers[shard] = self._open(file)
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
        """The tensor's data on the CPU, with the header's shape, in memory of its own (not the file's mapping).

        Only the dtypes of ``TORCH_DTYPES`` are read: torch holds the sub-byte ones (``F4``,
        ``F6_*``) in a shape other than the header's.
        """
        info = self.info(name)
        if info.dtype not in TORCH_DTYPES:
            raise ValueError(f"{info.file}: tensor {name!r} has dtype {info.dtype}, which moe_fp4 does not read "
                             f"(it reads {', '.join(TORCH_DTYPES)})")
        try:
            return self._files[info.file].get_tensor(name).clone()
        except SafetensorError as exc:
            raise ValueError(f"{info.file}: tensor {name!r} cannot be read ({exc})") from None

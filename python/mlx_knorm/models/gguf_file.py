"""A GGUF file's metadata and tensors.

The layout (GGUF v2 and v3, little-endian) is read here directly, with the
type codes of llama.cpp's ``gguf`` package: its reader builds a NumPy view per
metadata item and takes seconds on a vocabulary of 50k tokens, where this
takes a fraction of one. Tensor data stays in the memory-mapped file until a
tensor is converted.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32


class UnsupportedGGUF(ValueError):
    """A GGUF file this package cannot turn into an exactly equivalent mlx-lm model; the message names what."""


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a file that starts with the GGUF magic bytes."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: int  # a gguf.GGMLQuantizationType value
    shape: tuple[int, ...]  # GGUF order: innermost (the row length) first
    data: np.ndarray  # NumPy order, rows first; quantized types as uint8 bytes per row


@dataclass
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    @property
    def architecture(self) -> str:
        return self.metadata.get("general.architecture", "")

    def arch_key(self, key: str, default: Any = None) -> Any:
        """``{architecture}.{key}``, e.g. ``arch_key("attention.head_count")``."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _Cursor:
    def __init__(self, buffer, path: Path):
        self.buffer, self.offset, self.path = buffer, 0, path

    def take(self, fmt: str):
        try:
            (value,) = struct.unpack_from(fmt, self.buffer, self.offset)
        except struct.error:
            raise UnsupportedGGUF(f"{self.path.name}: truncated at byte {self.offset}") from None
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.take("<Q")
        end = self.offset + length
        if end > len(self.buffer):
            raise UnsupportedGGUF(f"{self.path.name}: truncated at byte {self.offset}")
        try:
            text = bytes(self.buffer[self.offset:end]).decode("utf-8")
        except UnicodeDecodeError:
            raise UnsupportedGGUF(f"{self.path.name}: a string at byte {self.offset} is not UTF-8") from None
        self.offset = end
        return text

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.take("<I"), self.take("<Q")
            if item in _SCALARS and item != 7:
                dtype = np.dtype(_SCALARS[item])
                values = np.frombuffer(self.buffer, dtype, count, self.offset)
                self.offset += dtype.itemsize * count
                return values.tolist()
            return [self.value(item) for _ in range(count)]
        raise UnsupportedGGUF(f"{self.path.name}: unknown metadata value type {kind} at byte {self.offset}")


def open_gguf(path: str | Path) -> GGUFFile:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    if not is_gguf(path):
        raise ValueError(f"{path} is not a GGUF file")
    with open(path, "rb") as f:
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cursor = _Cursor(buffer, path)
    cursor.offset = 4
    version = cursor.take("<I")
    if version not in (2, 3):
        raise UnsupportedGGUF(f"{path.name}: GGUF version {version} (a big-endian file, or too old or new); "
                              "versions 2 and 3, little-endian, are read")
    n_tensors, n_metadata = cursor.take("<Q"), cursor.take("<Q")
    metadata = {}
    for _ in range(n_metadata):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.take("<I"))
    if int(metadata.get("split.count", 1)) > 1:
        raise UnsupportedGGUF(f"{path.name} is one part of a split GGUF model (split.count = "
                              f"{metadata['split.count']}); merge the parts first "
                              "(llama.cpp's `llama-gguf-split --merge`)")
    infos = []
    for _ in range(n_tensors):
        name = cursor.string()
        dims = tuple(cursor.take("<Q") for _ in range(cursor.take("<I")))
        infos.append((name, dims, cursor.take("<I"), cursor.take("<Q")))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    start = -(-cursor.offset // alignment) * alignment
    tensors = {}
    for name, dims, kind, offset in infos:
        try:
            tensor_type = GGMLQuantizationType(kind)
        except ValueError:
            raise UnsupportedGGUF(f"{path.name}: tensor {name!r} has unknown type code {kind}") from None
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        if dims[0] % block_size:
            raise UnsupportedGGUF(f"{path.name}: tensor {name!r} has rows of {dims[0]} values, not whole "
                                  f"{tensor_type.name} blocks of {block_size}")
        shape = tuple(reversed(dims))
        n_bytes = int(np.prod(dims, dtype=np.int64)) // block_size * type_size
        if start + offset + n_bytes > len(buffer):
            raise UnsupportedGGUF(f"{path.name}: tensor {name!r} runs past the end of the file")
        data = np.frombuffer(buffer, np.uint8, n_bytes, start + offset)
        if block_size == 1:
            data = data.view(np.dtype(_NUMPY_TYPES.get(tensor_type.name, "u1"))).reshape(shape)
        else:
            data = data.reshape(*shape[:-1], dims[0] // block_size * type_size)
        if name in tensors:
            raise UnsupportedGGUF(f"{path.name}: tensor {name!r} appears twice")
        tensors[name] = GGUFTensor(name=name, tensor_type=int(tensor_type), shape=dims, data=data)
    return GGUFFile(path=path, metadata=metadata, tensors=tensors)


# Types of one value per block, as NumPy holds them (BF16 as its 16 bits: NumPy has no bfloat16).
_NUMPY_TYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "F64": "<f8", "I8": "i1", "I16": "<i2", "I32": "<i4",
                "I64": "<i8"}

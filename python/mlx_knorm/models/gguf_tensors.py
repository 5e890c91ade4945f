"""GGUF tensors as MLX arrays.

Q4_0, Q4_1 and Q8_0 are MLX affine quantization (``w = scale * q + bias``,
groups of 32) exactly, so their blocks are repacked bit for bit:

- Q4_0: ``w = d * (q - 8)``, q in [0, 16): scale ``d``, bias ``-8 d``;
- Q4_1: ``w = d * q + m``: scale ``d``, bias ``m``;
- Q8_0: ``w = d * q``, q in [-128, 128): code ``q + 128``, scale ``d``, bias ``-128 d``.

F32, F16 and BF16 stay as stored. Every other type (the K-quants, the
I-quants, ...) has no exact MLX form: llama.cpp's ``gguf`` package dequantizes
it to float32, and it stays float32 or, if asked, is quantized again with
``mx.quantize`` (which changes the values: the choice is reported).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from .gguf_file import UnsupportedGGUF

Q = GGMLQuantizationType
EXACT_AFFINE_BITS = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q8_0: 8}
FLOAT_TYPES = {Q.F32: mx.float32, Q.F16: mx.float16, Q.BF16: mx.bfloat16}
FLOAT_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
REQUANTIZE_BITS = (2, 3, 4, 5, 6, 8)
REQUANTIZE_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class WeightFormat:
    """What the loader makes of the file's tensor types.

    ``dtype``: every weight becomes this float type, quantized ones
    dequantized (e.g. ``"float32"`` for a CPU whose BLAS is fast only in
    float32). ``requantize``: ``(bits, group_size)`` for the types without an
    exact MLX form, instead of dequantizing them to float32.
    """

    dtype: str | None = None
    requantize: tuple[int, int] | None = None

    @classmethod
    def of(cls, dtype=None, requantize=None) -> "WeightFormat":
        """Checked arguments: ``dtype`` a name or an ``mx.Dtype``; ``requantize`` a pair of ints."""
        if isinstance(dtype, mx.Dtype):
            dtype = next((name for name, d in FLOAT_DTYPES.items() if d == dtype), str(dtype))
        if isinstance(dtype, str) and dtype == "stored":
            dtype = None
        if dtype is not None and dtype not in FLOAT_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(FLOAT_DTYPES)}, 'stored', 'auto' or None, "
                             f"got {dtype!r}")
        if requantize is not None:
            if dtype is not None:
                raise ValueError("dtype and requantize exclude each other: dtype dequantizes every weight")
            pair = tuple(requantize) if isinstance(requantize, (tuple, list)) else ()
            if len(pair) != 2 or pair[0] not in REQUANTIZE_BITS or pair[1] not in REQUANTIZE_GROUP_SIZES:
                raise ValueError(f"requantize must be (bits, group_size) with bits in {REQUANTIZE_BITS} and "
                                 f"group_size in {REQUANTIZE_GROUP_SIZES}, got {requantize!r}")
            requantize = pair
        return cls(dtype=dtype, requantize=requantize)


@dataclass
class ConversionReport:
    """How many tensors of each GGUF type took each path."""

    counts: Counter = field(default_factory=Counter)  # (type name, what happened) -> tensors

    def add(self, type_name: str, what: str) -> None:
        self.counts[type_name, what] += 1

    def lines(self, *, changed_only: bool = False) -> list[str]:
        """One line per (type, path); ``changed_only``: leave out tensors kept as the file stores them."""
        return [f"{n} {type_name} tensor{'s' if n > 1 else ''} {what}"
                for (type_name, what), n in sorted(self.counts.items())
                if not (changed_only and what.startswith("kept"))]


def dequantize(name: str, tensor_type, data: np.ndarray) -> np.ndarray:
    """The tensor's values as float32 (``data`` as ``GGUFTensor.data`` holds it)."""
    tensor_type = Q(tensor_type)
    if tensor_type == Q.F32:
        return np.asarray(data, dtype=np.float32)
    if tensor_type == Q.F16:
        return np.asarray(data).astype(np.float32)
    if tensor_type == Q.BF16:
        return (np.asarray(data).astype(np.uint32) << 16).view(np.float32)
    try:
        return gguf_dequantize(np.asarray(data), tensor_type)
    except NotImplementedError:
        raise UnsupportedGGUF(f"tensor {name!r} has type {tensor_type.name}, which the gguf package "
                              "cannot dequantize") from None


def affine_from_blocks(tensor_type, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Repack Q4_0/Q4_1/Q8_0 blocks (uint8, rows x bytes) as MLX affine ``(weight, scales, biases)``.

    ``weight`` is uint32 with ``32 // bits`` codes per word, the first in the
    lowest bits (MLX's packing); scales and biases are float16 as in the file,
    float32 for both where a bias would not be exact in float16.
    """
    tensor_type = Q(tensor_type)
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    rows = blocks.shape[0]
    b = np.ascontiguousarray(blocks).reshape(rows, -1, type_size)
    d = b[..., 0:2].copy().view(np.float16)[..., 0]
    if tensor_type == Q.Q4_1:
        bias = b[..., 2:4].copy().view(np.float16)[..., 0]
        nibbles = b[..., 4:]
    elif tensor_type == Q.Q4_0:
        bias = -8.0 * d.astype(np.float32)
        nibbles = b[..., 2:]
    elif tensor_type == Q.Q8_0:
        bias = -128.0 * d.astype(np.float32)
        codes = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    else:
        raise ValueError(f"{tensor_type.name} is not an exact MLX affine type")
    if tensor_type in (Q.Q4_0, Q.Q4_1):
        # Byte i of a block holds element i in its low nibble and element i + 16 in its high one.
        codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)
    bits = EXACT_AFFINE_BITS[tensor_type]
    scales, biases = d, bias
    if bias.dtype != np.float16:
        with np.errstate(over="ignore"):  # an overflow is caught below
            biases = bias.astype(np.float16)
        if not np.array_equal(biases.astype(np.float32), bias):
            scales, biases = d.astype(np.float32), bias
    return pack_codes(codes.reshape(rows, -1), bits), scales, biases


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes (rows x columns) packed into uint32 words as MLX's quantized ops read them:
    ``32 // bits`` codes per word, the first in the lowest bits."""
    if bits == 4:
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    elif bits != 8:
        raise ValueError(f"only 4- and 8-bit codes are packed here, not {bits}")
    return np.ascontiguousarray(codes).view("<u4").astype(np.uint32, copy=False)


def float_array(tensor_type, data: np.ndarray) -> mx.array:
    tensor_type = Q(tensor_type)
    if tensor_type == Q.BF16:
        return mx.array(np.ascontiguousarray(data)).view(mx.bfloat16)
    return mx.array(np.ascontiguousarray(data))


def to_mlx(name: str, tensor_type, data: np.ndarray, *, quantizable: bool, fmt: WeightFormat,
           report: ConversionReport, values: np.ndarray | None = None) -> dict[str, mx.array]:
    """One GGUF tensor as ``{"weight": ...}`` or ``{"weight", "scales", "biases"}``.

    ``quantizable``: the tensor is the weight of a Linear or Embedding layer.
    ``values``: float32 values to use instead of the file's (a tensor the
    architecture transforms, e.g. gemma's norms).
    """
    tensor_type = Q(tensor_type)
    kind = tensor_type.name
    if values is None and fmt.dtype is None:
        if tensor_type in FLOAT_TYPES:
            report.add(kind, "kept")
            return {"weight": float_array(tensor_type, data)}
        if tensor_type in EXACT_AFFINE_BITS and quantizable:
            weight, scales, biases = affine_from_blocks(tensor_type, data)
            bits, group_size = EXACT_AFFINE_BITS[tensor_type], GGML_QUANT_SIZES[tensor_type][0]
            report.add(kind, f"kept as MLX {bits}-bit affine quantization, group {group_size} (exact)")
            return {"weight": mx.array(weight), "scales": mx.array(scales), "biases": mx.array(biases)}
    if fmt.dtype is not None and values is None and tensor_type in FLOAT_TYPES \
            and FLOAT_TYPES[tensor_type] == FLOAT_DTYPES[fmt.dtype]:
        report.add(kind, "kept")
        return {"weight": float_array(tensor_type, data)}
    transformed = values is not None
    how = "offset as the architecture needs" if transformed else (
        "cast" if tensor_type in FLOAT_TYPES else "dequantized")
    if values is None:
        values = dequantize(name, tensor_type, data)
    if fmt.dtype is not None and fmt.dtype != "float32":
        report.add(kind, f"{how} to {fmt.dtype} (rounded)")
        return {"weight": mx.array(values).astype(FLOAT_DTYPES[fmt.dtype])}
    if fmt.requantize is not None and quantizable and values.shape[-1] % fmt.requantize[1] == 0:
        bits, group_size = fmt.requantize
        weight, scales, biases = mx.quantize(mx.array(values).astype(mx.float16), group_size=group_size, bits=bits)
        report.add(kind, f"re-quantized to MLX {bits}-bit affine quantization, group {group_size} (not exact)")
        return {"weight": weight, "scales": scales, "biases": biases}
    report.add(kind, f"{how} to float32{'' if transformed else ' (exact)'}")
    return {"weight": mx.array(values)}

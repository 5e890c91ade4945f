"""``mlx-knorm doctor``: one report on how mlx-knorm runs on this machine.

It prints, and writes as Markdown and JSON to attach to an issue:

- what loaded: the extension, the MLX it was built against, the backends
  with kernels on each device, the Metal kernel library (the prebuilt
  metallib or the JIT sources);
- every op on the chosen device, each native backend there (the CPU kernel
  or the Metal kernels; the emulator where it is built) against the pure-MLX
  fallback, bit for bit, over a grid of shapes, dtypes and the edges the
  test suite holds: NaN scores of every kind (signalling ones included),
  ties, signed zeros, float16 subnormal keys, every row of a head evicted
  but the protected ones, buffers updated in place;
- kernel and fallback times on that device (warm process, medians, page
  faults per call);
- a short generation on the model shipped with the package (mlx-lm's
  llama, 4 layers) with ``make_knorm_cache``: equal to mlx-lm's own cache
  while the budget holds every token, bounded past it.

The device is a parameter: on a Mac ``--device gpu`` runs the same code on
the Metal kernels that this machine runs on the CPU kernel and the emulator.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np

from . import __version__
from .atomic import write_text
from .backend import backend_info, native_available, use_backend
from .blas import blas_in_use, blas_line
from .extras import install_hint
from .ops import evict_and_fill, key_norms, protected_topk_gather, row_scores

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
# float32 NaNs a float load or store may change: signalling (quiet bit
# clear) and quiet with payloads, of either sign.
NAN_BITS = np.array([0x7FA00000, 0xFF800001, 0x7F800123, 0x7FC00001, 0xFFC12345], dtype=np.uint32)


def _keys(rng: np.random.Generator, shape, palette: str, dtype: str) -> mx.array:
    """Keys whose values follow ``palette``."""
    if palette == "subnormal":  # float16 subnormals (and their bfloat16/float32 roundings)
        x = rng.integers(1, 0x400, size=shape) * 2.0**-24 * rng.choice([-1.0, 1.0], size=shape)
    elif palette == "special":
        x = rng.standard_normal(shape)
        mask = rng.random(shape) < 0.1
        x[mask] = rng.choice([np.nan, np.inf, -np.inf, 0.0, -0.0], size=int(mask.sum()))
    elif palette == "ties":
        x = rng.integers(-1, 2, size=shape).astype(np.float64)
    else:
        x = rng.standard_normal(shape)
    return mx.array(x.astype(np.float32)).astype(DTYPES[dtype])


def _norms(rng: np.random.Generator, shape, palette: str) -> mx.array:
    """float32 scores: NaN bits of every kind, ties, signed zeros or spread."""
    if palette == "nan":
        bits = rng.integers(0x3F000000, 0x40000000, size=shape).astype(np.uint32)
        mask = rng.random(shape) < 0.3
        bits[mask] = rng.choice(NAN_BITS, size=int(mask.sum()))
        return mx.array(bits).view(mx.float32)
    if palette == "ties":
        return mx.array(rng.integers(0, 3, size=shape).astype(np.float32))
    if palette == "zeros":
        return mx.array(np.where(rng.random(shape) < 0.5, np.float32(0.0), np.float32(-0.0)))
    return mx.array(np.abs(rng.standard_normal(shape)).astype(np.float32))


@dataclass(frozen=True)
class OpCase:
    """One call of an op: ``make()`` builds its arrays afresh (so that with
    ``donate`` the op holds the only reference to the first ``donate`` of
    them, and updates them in place where it can) and its keywords."""

    op: str
    label: str
    make: Callable[[], tuple[list, dict]]
    donate: int = 0


def _key_norms_cases() -> list[OpCase]:
    cases = []
    for dtype in DTYPES:
        for dim in (1, 33, 128, 512):
            for palette in ("normal", "special", "subnormal", "ties"):
                def make(dtype=dtype, dim=dim, palette=palette):
                    rng = np.random.default_rng(dim)
                    return [_keys(rng, (3, 37, dim), palette, dtype)], {}
                cases.append(OpCase("key_norms", f"{dtype} D={dim} {palette}", make))
    return cases


def _gather_cases() -> list[OpCase]:
    # (heads, n_prior, n_new, D_k, D_v, budget, n_sink, recent): a prompt, a
    # decode step, every middle row evicted, nothing evicted, many heads of
    # long rows, different key and value widths.
    shapes = [(2, 0, 40, 64, 64, 16, 4, 4), (3, 300, 1, 128, 128, 300, 4, 8), (2, 50, 30, 16, 16, 7, 3, 3),
              (2, 20, 10, 32, 32, 64, 4, 4), (2, 300, 300, 80, 48, 300, 2, 7)]
    cases = []
    for i, (heads, n_prior, n_new, dk, dv, budget, n_sink, recent) in enumerate(shapes):
        for (kdtype, vdtype), palette, keep in (
                (("float16", "float16"), "nan", "low"), (("bfloat16", "float32"), "ties", "high"),
                (("float32", "float16"), "zeros", "low")):
            def make(i=i, shape=(heads, n_prior, n_new, dk, dv), kdtype=kdtype, vdtype=vdtype, palette=palette,
                     config=(budget, n_sink, recent, keep)):
                rng = np.random.default_rng(i)
                h, p, s, dk, dv = shape
                arrays = [_keys(rng, (h, p, dk), "special", kdtype), _keys(rng, (h, p, dv), "normal", vdtype),
                          _norms(rng, (h, p), palette), _keys(rng, (h, s, dk), "special", kdtype),
                          _keys(rng, (h, s, dv), "normal", vdtype), _norms(rng, (h, s), palette)]
                return arrays, dict(zip(("budget", "n_sink", "recent", "keep"), config))
            label = f"N={heads} prior={n_prior} S={n_new} D={dk}/{dv} budget={budget} {kdtype}/{vdtype} {palette} {keep}"
            # In place where the prior already holds the budget's rows.
            donate = 3 if n_prior == budget else 0
            cases.append(OpCase("protected_topk_gather", label, make, donate))
    return cases


def _evict_cases() -> list[OpCase]:
    # (heads, slots, filled, n_new, D, budget, n_sink, recent): a decode
    # step at the budget, a prompt chunk past it, nothing leaving, a long
    # temporal compaction.
    shapes = [(4, 257, 257, 1, 128, 256, 4, 8), (2, 200, 120, 80, 64, 100, 4, 20), (2, 64, 30, 10, 32, 64, 4, 4),
              (3, 700, 650, 50, 16, 300, 2, 0)]
    cases = []
    for i, (heads, slots, filled, n_new, dim, budget, n_sink, recent) in enumerate(shapes):
        for layout, dtype, palette, keep in (("slots", "float16", "nan", "low"), ("temporal", "bfloat16", "ties", "high"),
                                             ("slots", "float32", "zeros", "low")):
            def make(i=i, heads=heads, slots=slots, filled=filled, n_new=n_new, dim=dim, layout=layout, dtype=dtype,
                     palette=palette, config=(budget, n_sink, recent, keep)):
                rng = np.random.default_rng(100 + i)
                positions = np.stack([rng.permutation(slots) for _ in range(heads)]).astype(np.int32)
                if layout == "temporal":
                    positions = np.sort(positions, axis=1)
                arrays = [_keys(rng, (heads, slots, dim), "special", dtype), _keys(rng, (heads, slots, dim), "normal", dtype),
                          _norms(rng, (heads, slots), palette), mx.array(positions),
                          _keys(rng, (heads, n_new, dim), "special", dtype), _keys(rng, (heads, n_new, dim), "normal", dtype)]
                config = dict(zip(("budget", "n_sink", "recent", "keep"), config))
                return arrays, dict(filled=filled, offset=slots, capacity=slots, layout=layout, **config)
            label = (f"N={heads} slots={slots} filled={filled} S={n_new} D={dim} budget={budget} {layout} {dtype} "
                     f"{palette} {keep}")
            # In place where the step's output fits the slots it has.
            donate = 4 if filled - max(0, filled - budget) + n_new <= slots else 0
            cases.append(OpCase("evict_and_fill", label, make, donate))
    return cases


def _row_score_cases() -> list[OpCase]:
    cases = []
    for scorer in ("knorm", "vnorm", "qfilter", "keydiff"):
        for dtype, dim, palette in (("float16", 64, "special"), ("bfloat16", 128, "subnormal"),
                                    ("float32", 33, "ties")):
            def make(scorer=scorer, dtype=dtype, dim=dim, palette=palette):
                rng = np.random.default_rng(dim)
                arrays = [_keys(rng, (2, 4, 19, dim), palette, dtype),
                          _keys(rng, (2, 4, 19, dim), "normal", dtype) if scorer == "vnorm" else None,
                          mx.array(rng.standard_normal((2, 4, dim)).astype(np.float32))
                          if scorer in ("qfilter", "keydiff") else None]
                valid = mx.array(np.tile(np.array([3, 17], np.int32), (2, 4, 1)))
                return arrays, dict(scorer=scorer, offset=2, valid=valid)
            cases.append(OpCase("row_scores", f"{scorer} {dtype} D={dim} {palette}", make))
    return cases


OPS = {"key_norms": key_norms, "row_scores": row_scores, "protected_topk_gather": protected_topk_gather,
       "evict_and_fill": evict_and_fill}


def op_cases() -> list[OpCase]:
    """The grid the doctor runs: every op over shapes, dtypes and edges."""
    return _key_norms_cases() + _row_score_cases() + _gather_cases() + _evict_cases()


def _output_list(out) -> list[mx.array]:
    flat = []
    for o in out if isinstance(out, (tuple, list)) else [out]:
        if isinstance(o, (tuple, list)):
            flat.extend(_output_list(o))
        elif o is not None:
            flat.append(o)
    return flat


def _address(a: mx.array) -> int:
    """Where ``a``'s data lives (MLX's memory is the CPU's and the GPU's),
    read through a bytes view that shares it (numpy has no bfloat16)."""
    return np.asarray(a.view(mx.uint8)).__array_interface__["data"][0]


def run_case(case: OpCase, backend: str, stream) -> tuple[list[mx.array], bool]:
    """The case's outputs on ``backend`` as far as the spec defines them (a
    step's slots past kept + S are not), and whether its first output took
    over a donated input's buffer (an update in place)."""
    arrays, config = case.make()
    mx.eval(arrays)
    donated = _address(arrays[0]) if case.donate and arrays[0].size else None
    with use_backend(backend):
        out = OPS[case.op](*arrays, **config, stream=stream)
    defined = None
    if case.op == "evict_and_fill":
        defined = min(config["filled"], config["budget"]) + arrays[4].shape[1]
    del arrays[: case.donate]
    mx.eval(out)
    outputs = _output_list(out)
    in_place = donated is not None and _address(outputs[0]) == donated
    if defined is not None:
        outputs = [o[:, :defined] for o in outputs]
    return outputs, in_place


def same_bits(a: mx.array, b: mx.array) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and (
        a.size == 0 or mx.array_equal(a.reshape(-1).view(mx.uint8), b.reshape(-1).view(mx.uint8)).item())


def check_ops(device, backends: list[str], progress=print, ops=tuple(OPS)) -> list[dict]:
    """Every case of ``ops`` on each of ``backends`` against the fallback, on ``device``."""
    stream = mx.default_stream(device)
    rows = []
    for case in (c for c in op_cases() if c.op in ops):
        expected, _ = run_case(case, "fallback", stream)
        for backend in backends:
            row = {"op": case.op, "case": case.label, "backend": backend, "donated": case.donate > 0}
            try:
                outputs, in_place = run_case(case, backend, stream)
                row["bit_exact"] = len(outputs) == len(expected) and all(map(same_bits, outputs, expected))
                row["in_place"] = in_place
            except Exception as err:  # a refusal is a finding, not a crash of the report
                row["bit_exact"] = False
                row["error"] = f"{type(err).__name__}: {err}"
            if not row["bit_exact"]:
                progress(f"  MISMATCH {case.op} [{backend}] {case.label} {row.get('error', '')}")
            rows.append(row)
    return rows


def _median_ms(run, reps: int = 25) -> dict:
    from .bench.timing import summary, time_runs

    samples, faults = time_runs(run, reps, warmup=3, max_seconds=2.0)
    return summary(samples, faults)


def time_ops(device) -> list[dict]:
    """Kernel against fallback on ``device``: a decode step and a prompt of
    the gather and of the cache step, and key norms of a prompt (32 heads,
    D = 128, float16)."""
    from .bench.timing import warm_up

    stream = mx.default_stream(device)
    rng = np.random.default_rng(0)
    warm_up()
    heads, dim = 32, 128
    prior = [_keys(rng, (heads, 512, dim), "normal", "float16"), _keys(rng, (heads, 512, dim), "normal", "float16"),
             _norms(rng, (heads, 512), "normal")]
    decode = [_keys(rng, (heads, 1, dim), "normal", "float16"), _keys(rng, (heads, 1, dim), "normal", "float16"),
              _norms(rng, (heads, 1), "normal")]
    prompt = [_keys(rng, (heads, 4096, dim), "normal", "float16"), _keys(rng, (heads, 4096, dim), "normal", "float16"),
              _norms(rng, (heads, 4096), "normal")]
    empty = [mx.zeros((heads, 0, dim), mx.float16), mx.zeros((heads, 0, dim), mx.float16), mx.zeros((heads, 0))]
    # A cache's buffers at a decode step: the budget's rows and the last
    # step's new one (the outputs are fresh buffers: the arrays are held).
    slots = [_keys(rng, (heads, 513, dim), "normal", "float16"), _keys(rng, (heads, 513, dim), "normal", "float16"),
             _norms(rng, (heads, 513), "normal"), mx.array(np.tile(np.arange(513, dtype=np.int32), (heads, 1)))]
    step = dict(filled=513, offset=513, capacity=513, budget=512, n_sink=4, recent=256, keep="low")
    calls = {
        "key_norms prompt S=4096": lambda: key_norms(prompt[0], stream=stream),
        "protected_topk_gather decode S=1, budget 512": lambda: protected_topk_gather(
            *prior, *decode, 512, 4, 0, "low", stream=stream),
        "protected_topk_gather prompt S=4096, budget 512": lambda: protected_topk_gather(
            *empty, *prompt, 512, 4, 0, "low", stream=stream),
        "evict_and_fill decode S=1, budget 512, fresh outputs": lambda: evict_and_fill(
            *slots, decode[0], decode[1], **step, stream=stream),
    }
    mx.eval(prior, decode, prompt, empty, slots)
    rows = []
    for label, call in calls.items():
        row = {"case": label}
        for backend in ("kernel", "fallback"):
            with use_backend(backend):
                row[backend] = _median_ms(lambda: mx.eval(call()))
        row["fallback_over_kernel"] = row["fallback"]["median_ms"] / row["kernel"]["median_ms"]
        rows.append(row)
    return rows


def generation_check(budget: int = 64) -> dict:
    """Greedy generation on the shipped model with ``make_knorm_cache``:
    token for token mlx-lm's own cache's while every token fits the budget,
    then past it with every compressed layer at most ``budget`` rows."""
    try:
        from mlx_lm.generate import generate_step
        from mlx_lm.models.cache import make_prompt_cache
    except ImportError:
        return {"ran": False, "why": f"mlx-lm is not installed: {install_hint('lm')}"}
    from .cache import L2NormKVCache, make_knorm_cache
    from .quality.cli import load

    model, tokenizer, _ = load(None)
    prompt = mx.array(tokenizer.encode("def evict(cache, budget):\n    "))

    def tokens(cache, n):
        steps = generate_step(prompt, model, prompt_cache=cache)
        return [int(token) for (token, _), _ in zip(steps, range(n))]

    # The cache holds the prompt and every token but the last it produced.
    within = budget - prompt.size + 1
    ours = tokens(make_knorm_cache(model, budget=budget), within)
    theirs = tokens(make_prompt_cache(model), within)
    cache = make_knorm_cache(model, budget=budget)
    start = time.perf_counter()
    past = tokens(cache, 4 * budget)
    seconds = time.perf_counter() - start
    sizes = [c.size() for c in cache if isinstance(c, L2NormKVCache)]
    return {
        "ran": True,
        "model": "the package's llama (4 layers, byte tokenizer)",
        "budget": budget,
        "tokens_within_budget": within,
        "equal_to_mlx_lm_within_budget": ours == theirs,
        "tokens_past_budget": len(past),
        "rows_per_compressed_layer": sizes,
        "bounded": bool(sizes) and max(sizes) <= budget,
        "tokens_per_second": len(past) / seconds,
    }


def environment(device) -> dict:
    info = backend_info()
    env = {
        "mlx_knorm": __version__,
        "mlx": mx.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "device": "gpu" if device == mx.gpu else "cpu",
        "backends": info,
        "blas": blas_in_use(),
    }
    if device == mx.gpu:
        env["gpu"] = {k: v for k, v in mx.device_info().items() if isinstance(v, (int, float, str))}
    return env


def native_backends(device) -> list[str]:
    """The native backends that run on ``device``: its kernel where the
    extension has one, and the emulator (a CPU stream) where it is built."""
    info = backend_info()["kernels"]
    names = ["kernel"] if info.get("gpu" if device == mx.gpu else "cpu") else []
    if device == mx.cpu and info.get("metal-emulator"):
        names.append("metal-emulator")
    return names


def markdown(report: dict) -> str:
    env, checks = report["environment"], report["checks"]
    info = env["backends"]
    library = info.get("metal_kernel_library") or {}
    lines = [f"# mlx-knorm doctor: {'all good' if report['ok'] else 'PROBLEMS FOUND'}", "",
             f"- mlx-knorm {env['mlx_knorm']}, MLX {env['mlx']} (extension built against "
             f"{info['mlx_version_built']}), Python {env['python']}, {env['platform']}",
             f"- device: {env['device']}; native kernels: "
             + ", ".join(k for k, v in info["kernels"].items() if v) + "; "
             + (f"Metal library: {library.get('kind')} ({library.get('path')})" if library else "no Metal library"),
             f"- BLAS of MLX's CPU matmuls: {blas_line()}",
             ]
    if not info["extension_loaded"]:
        lines.append(f"- the extension did not load: {info['extension_error']}")
    lines += ["", "## Bit for bit against the fallback", "",
              "| op | backend | cases | bit-exact | in place / inputs donated |", "|---|---|---|---|---|"]
    for op in OPS:
        for backend in sorted({r["backend"] for r in checks}):
            rows = [r for r in checks if r["op"] == op and r["backend"] == backend]
            if rows:
                donated = sum(r["donated"] for r in rows)
                in_place = f"{sum(r.get('in_place', False) for r in rows)} / {donated}" if donated else "-"
                lines.append(f"| {op} | {backend} | {len(rows)} | {sum(r['bit_exact'] for r in rows)} | {in_place} |")
    bad = [r for r in checks if not r["bit_exact"]]
    lines += [""] + [f"- MISMATCH {r['op']} [{r['backend']}] {r['case']} {r.get('error', '')}" for r in bad]
    if report.get("timings"):
        lines += ["## Kernel and fallback times on this device (medians)", "",
                  "| case | kernel ms | fallback ms | fallback / kernel | faults per call (kernel) |",
                  "|---|---|---|---|---|"]
        for t in report["timings"]:
            lines.append(f"| {t['case']} | {t['kernel']['median_ms']:.3f} | {t['fallback']['median_ms']:.3f} "
                         f"| {t['fallback_over_kernel']:.1f}x | {t['kernel']['faults_per_call']:.1f} |")
        lines.append("")
    g = report.get("generation")
    if g:
        lines += ["## Generation with make_knorm_cache", ""]
        if g["ran"]:
            lines += [f"- {g['model']}, budget {g['budget']}: the first {g['tokens_within_budget']} tokens "
                      f"{'equal' if g['equal_to_mlx_lm_within_budget'] else 'DIFFER FROM'} mlx-lm's own cache's;",
                      f"- {g['tokens_past_budget']} tokens past the budget at {g['tokens_per_second']:.0f} tokens/s, "
                      f"rows kept per compressed layer {sorted(set(g['rows_per_compressed_layer']))} "
                      f"({'bounded' if g['bounded'] else 'NOT BOUNDED'} by the budget)."]
        else:
            lines.append(f"- not run: {g['why']}")
    return "\n".join(lines) + "\n"


def run(device_name: str, out: Path, timings: bool = True, generation: bool = True, progress=print,
        ops=tuple(OPS)) -> dict:
    check_ops_named(ops)
    device = mx.gpu if device_name == "gpu" else mx.cpu
    previous = mx.default_device()
    mx.set_default_device(device)
    try:
        report = {"environment": environment(device)}
        backends = native_backends(device)
        progress(f"mlx-knorm doctor on the {device_name.upper()}: {', '.join(backends) or 'no native backend'} "
                 "against the fallback")
        report["checks"] = check_ops(device, backends, progress, ops)
        if timings and "kernel" in backends:
            progress("timing kernel and fallback")
            report["timings"] = time_ops(device)
        if generation:
            progress("generating with make_knorm_cache")
            report["generation"] = generation_check()
    finally:
        mx.set_default_device(previous)
    g = report.get("generation") or {}
    report["ok"] = bool(backends) and bool(report["checks"]) and all(r["bit_exact"] for r in report["checks"]) and (
        not g.get("ran") or (g["equal_to_mlx_lm_within_budget"] and g["bounded"]))
    # Both rendered before either is written: a failure leaves the last pair.
    texts = {".json": json.dumps(report, indent=2) + "\n", ".md": markdown(report)}
    for suffix, text in texts.items():
        write_text(out.with_suffix(suffix), text)
    return report


def check_ops_named(ops) -> None:
    """``ValueError`` unless ``ops`` names at least one op, each known: a
    report of no checks would say all good having checked nothing."""
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        raise ValueError(f"unknown {unknown}; the ops are {', '.join(OPS)}")
    if not ops:
        raise ValueError(f"names no op; give one or more of {', '.join(OPS)}")


def register(commands) -> None:
    parser = commands.add_parser(
        "doctor", help="check every op bit for bit on this machine, time it, generate; write a report")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="gpu" if mx.metal.is_available() else "cpu",
                        help="the device to check (default: the GPU where Metal is available)")
    parser.add_argument("--out", type=Path, default=Path("mlx-knorm-doctor"),
                        help="the report's path without suffix: OUT.md and OUT.json (default: ./mlx-knorm-doctor)")
    parser.add_argument("--no-timings", action="store_true", help="skip the kernel and fallback timings")
    parser.add_argument("--no-generation", action="store_true", help="skip the generation on the shipped model")
    parser.add_argument("--ops", type=lambda t: [v for v in t.split(",") if v], default=list(OPS),
                        help=f"the ops to check, comma-separated (default: all of {', '.join(OPS)})")
    parser.set_defaults(func=doctor_command)


def doctor_command(args) -> int:
    if args.device == "gpu" and not mx.metal.is_available():
        print("mlx-knorm doctor: --device gpu needs Metal; none is available here", file=sys.stderr)
        return 2
    if not native_available():
        print("mlx-knorm doctor: the native extension is not loaded; checking the fallback alone", file=sys.stderr)
    try:
        check_ops_named(args.ops)
    except ValueError as e:
        print(f"mlx-knorm doctor: --ops: {e}", file=sys.stderr)
        return 2
    report = run(args.device, args.out, timings=not args.no_timings, generation=not args.no_generation,
                 ops=tuple(args.ops))
    print(markdown(report))
    print(f"report: {args.out.with_suffix('.md')} and {args.out.with_suffix('.json')}")
    return 0 if report["ok"] else 1

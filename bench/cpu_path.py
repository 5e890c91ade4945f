"""Time one forward pass of a prompt through a packaged model, as ``mlx_knorm.models.load`` gives it.

The figure behind "the fast CPU path" (docs/benchmarks.md): run it once as a
new user's process runs (``--dtype auto``, whatever BLAS the process has) and
once each way you want to compare, e.g.::

    MLX_KNORM_FAST_BLAS=0 python bench/cpu_path.py --dtype stored   # before: Q4_1 weights, bundled BLAS
    python bench/cpu_path.py                                        # the default: re-executes with OpenBLAS

Prints and appends one JSON line to ``--out``: the model, tokens, weight
format, the BLAS MLX called, the load and forward seconds (median of
``--rounds``, after one warm-up forward).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from mlx_knorm.blas import blas_in_use, reexec_with_fast_blas


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", default=None, help="a JSON-lines file to append the record to")
    args = parser.parse_args()
    reexec_with_fast_blas()

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlx_knorm.models import load

    start = time.perf_counter()
    model, _ = load(args.model, dtype=args.dtype)
    load_s = time.perf_counter() - start
    weight_dtypes = sorted({str(v.dtype) for _, v in tree_flatten(model.parameters())})
    tokens = mx.array([[(7 * i + 11) % 1000 + 100 for i in range(args.tokens)]])
    times = []
    for _ in range(args.rounds + 1):
        start = time.perf_counter()
        mx.eval(model(tokens))
        times.append(time.perf_counter() - start)
    record = {"model": args.model, "tokens": args.tokens, "dtype_argument": args.dtype,
              "weight_dtypes": weight_dtypes, "blas": blas_in_use(), "load_s": round(load_s, 2),
              "forward_s_median": round(statistics.median(times[1:]), 2), "forward_s_first": round(times[0], 2),
              "rounds": args.rounds, "load_average": os.getloadavg()[0], "cpus": os.cpu_count(),
              "argv": sys.argv[1:], "fast_blas_env": os.environ.get("MLX_KNORM_FAST_BLAS")}
    print(json.dumps(record))
    if args.out:
        with open(args.out, "a") as out:
            out.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``mlx-knorm server``'s resident memory under requests that each set other
cache values (docs/commands.md; issue 52's target: under 2 MB of growth over
2,000 requests after warm-up).

    python bench/server_memory.py --json bench/results/server-memory-cpu.json

One server process on a free loopback port (the shipped byte-level model by
default, ``--budget 64``), stopped by its process id at the end. After
``--warm-up`` requests, ``--requests`` more, each a short completion whose
every per-request cache field (``budget``, ``n_sink``, ``recent``,
``keep``, ``layout``, ``scorer``, ``skip_layers``) and sampling field
(``temperature``, ``seed``, ``max_tokens``) comes from a counter, so that
no two requests share their cache settings; the server's RSS
(``/proc/PID/status``) is read every ``--sample-every`` requests. The
prompt store holds at most ``--prompt-cache-size`` conversations and the
memo of batchable settings at most ``BATCHABLE_MEMO_SIZE`` (both logged or
stated); RSS growth is the last sample less the first after warm-up.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

from mlx_knorm import __version__
from mlx_knorm.bench.cli import write_json
from mlx_knorm.bench.report import machine, now
from mlx_knorm.bench.server_process import ServerProcess
from mlx_knorm.commands.server import BATCHABLE_MEMO_SIZE
from mlx_knorm.commands.session import CACHE_FIELDS
from mlx_knorm.quality import MODEL_DIR

START_TIMEOUT_S = 120
REQUEST_TIMEOUT_S = 120
STORE = re.compile(r"mlx-knorm: prompt cache: (\d+) sequences, (\d+) bytes")
SCORERS = ("knorm", "keydiff", "vnorm")
# Prompts a request takes: a prompt of words never seen before grows the
# tokenizer's own word cache (Hugging Face tokenizers keeps up to 10,000
# words), stock mlx_lm.server's too (about 2 KB a request), which is not
# what this program measures.
PROMPTS = 10
# Budgets a request takes (a prime: with the other fields' periods, every
# request below 2,000 differs).
BUDGETS = 199
PROMPT = "import os\nimport sys\n\n\ndef main():\n    "
# What the growth over the requests after warm-up may be (issue 52's target).
TARGET_GROWTH_BYTES = 2 << 20


def varied_request(k: int) -> dict:
    """Request ``k``'s body: cache settings that no other ``k`` below 2,000
    shares, one of ``PROMPTS`` prompts, and sampling fields that change
    with it. The budget takes
    ``BUDGETS`` values in an order with no trend (a stored cache's buffers
    grow with its budget: budgets that rose through the run would grow the
    store's bytes, bounded as they are)."""
    n_sink = k % 4
    recent = (k // 4) % 3
    budget = n_sink + recent + 2 + (k * 7919) % BUDGETS
    return {"prompt": f"# {k % PROMPTS}\n{PROMPT}", "max_tokens": 2 + k % 3, "temperature": (k % 5) / 10,
            "seed": k, "budget": budget, "n_sink": n_sink, "recent": recent,
            "keep": ("low", "high")[k % 2], "layout": ("slots", "temporal")[(k // 2) % 2],
            "scorer": SCORERS[k % 3], "skip_layers": [0] if k % 7 == 0 else []}


def start_server(model: str, budget: int, prompt_cache_size: int, log_path: Path, stock: bool = False) -> ServerProcess:
    """``mlx-knorm server`` (or, ``stock``, ``mlx_lm.server``) on a free loopback port."""
    command = ([sys.executable, "-m", "mlx_lm", "server"] if stock
               else [sys.executable, "-m", "mlx_knorm", "server", "--budget", str(budget)])
    return ServerProcess([*command, "--model", model, "--prompt-cache-size", str(prompt_cache_size)], log_path,
                         start_timeout_s=START_TIMEOUT_S, request_timeout_s=REQUEST_TIMEOUT_S)


def measure(model: str, budget: int, prompt_cache_size: int, warm_up: int, requests: int, sample_every: int,
            deadline_s: float, log_dir: Path, baseline: str | None = None) -> dict:
    """The loop (module docstring): at most ``warm_up + requests`` requests,
    stopped early once ``deadline_s`` seconds have passed. ``baseline``:
    ``"one-setting"``, the same requests without their cache fields (every
    request the command line's settings); ``"stock"``, those sent to a stock
    ``mlx_lm.server``."""
    server = start_server(model, budget, prompt_cache_size, log_dir / "server-memory.log", stock=baseline == "stock")
    start = time.monotonic()
    samples, statuses, sent = [], {}, 0
    try:
        for k in range(warm_up + requests):
            if time.monotonic() - start > deadline_s:
                break
            if k >= warm_up and (k - warm_up) % sample_every == 0:
                samples.append({"after_requests": k - warm_up, "rss_bytes": server.rss()})
            body = varied_request(k)
            if baseline is not None:
                body = {f: v for f, v in body.items() if f not in CACHE_FIELDS}
            status, _ = server.post("/v1/completions", body)
            statuses[status] = statuses.get(status, 0) + 1
            sent += 1
        if sent > warm_up:
            samples.append({"after_requests": sent - warm_up, "rss_bytes": server.rss()})
        log = server.log_text()
    finally:
        server.stop()
    stored = [int(n) for n, _ in STORE.findall(log)]
    growth = samples[-1]["rss_bytes"] - samples[0]["rss_bytes"] if samples else None
    return {"requests_after_warm_up": max(0, sent - warm_up), "warm_up": warm_up,
            "statuses": {str(k): v for k, v in sorted(statuses.items())},
            "seconds": round(time.monotonic() - start, 1), "samples": samples,
            "rss_growth_bytes": growth, "target_growth_bytes": TARGET_GROWTH_BYTES,
            "prompt_store_sequences_max": max(stored, default=0), "prompt_cache_size": prompt_cache_size,
            "batchable_memo_cap": BATCHABLE_MEMO_SIZE}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(MODEL_DIR), help="the model served (default: the shipped one)")
    parser.add_argument("--budget", type=int, default=64, help="the server's --budget")
    parser.add_argument("--prompt-cache-size", type=int, default=10, help="the server's --prompt-cache-size")
    parser.add_argument("--warm-up", type=int, default=200, help="requests before the first sample")
    parser.add_argument("--requests", type=int, default=2000, help="requests after warm-up")
    parser.add_argument("--sample-every", type=int, default=100, help="requests between RSS samples")
    parser.add_argument("--deadline-s", type=float, default=3600, help="stop sending after this many seconds")
    parser.add_argument("--baseline", choices=("one-setting", "stock"),
                        help="the same requests without cache fields, to mlx-knorm server (one-setting) or to "
                             "a stock mlx_lm.server (stock): the growth that is not the cache fields'")
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as logs:
        result = measure(args.model, args.budget, args.prompt_cache_size, args.warm_up, args.requests,
                         args.sample_every, args.deadline_s, Path(logs), args.baseline)
    growth = result["rss_growth_bytes"]
    print(f"{result['requests_after_warm_up']} requests after {args.warm_up} to warm up "
          f"({result['statuses']} by HTTP status) in {result['seconds']} s: RSS grew by "
          f"{growth / 2**20:.2f} MiB (target < {TARGET_GROWTH_BYTES / 2**20:.0f} MiB); the prompt store held at "
          f"most {result['prompt_store_sequences_max']} conversations (--prompt-cache-size "
          f"{args.prompt_cache_size}), the batchable memo at most {BATCHABLE_MEMO_SIZE} settings")
    report = {"benchmark": "server_memory", "version": __version__, "date": now(), "machine": machine(),
              "command": " ".join(["python bench/server_memory.py", *(argv if argv is not None else sys.argv[1:])]),
              "model": args.model, "budget": args.budget, "baseline": args.baseline, **result}
    write_json(report, args.json)
    return 0 if growth is not None and growth < TARGET_GROWTH_BYTES else 1


if __name__ == "__main__":
    sys.exit(main())

"""``mlx-knorm generate`` and ``mlx-knorm server`` next to what a user bounding
the KV cache picks today: mlx-lm with a ``RotatingKVCache`` of the same size
(docs/benchmarks.md's commands table; the targets: decode tokens/s within 5%, peak
memory within 5%).

    python bench/commands.py --model DIR --json bench/results/commands-cpu.json

Both sides run mlx-lm's own code. ``generate``: ``mlx_lm.generate``'s
``main`` through ``mlx-knorm generate`` (``mlx_knorm.commands.generate``),
called in this process, once with its eviction caches
(``make_knorm_cache(budget, n_sink=4)``) and once with the model's
``make_cache`` giving ``RotatingKVCache(max_size=budget, keep=4)`` per layer,
which is what ``mlx_lm.generate --max-kv-size`` builds for a model without a
``make_cache`` of its own (mlx-lm's llama has one, so there the flag is
ignored). Decode tokens/s is mlx-lm's own ``Generation: ... tokens-per-sec``;
peak memory is ``mx.get_peak_memory()`` over the call (the figure behind
mlx-lm's ``Peak memory``, unrounded), reset before each call, so it holds
the weights the call loads, the cache and the prefill's activations.
``server``: two server processes, ``mlx-knorm server`` and the same server
with the ``RotatingKVCache`` factory (``python bench/commands.py
serve-baseline ...``), both serving through mlx-lm's batch loop
(``BatchGenerator``), as each batches its caches (``L2NormKVCache.merge``;
mlx-lm's ``BatchRotatingKVCache``), a batch of one here: one client sends
each the same streaming ``/v1/completions`` requests in turn. Each round
checks that both served the request the same way (batched or alone).
Decode tokens/s and peak memory are what each server logs for the request:
``Generation: ... tokens-per-sec`` and ``Peak memory`` as ``mlx_lm.generate``
prints them, from the request's insertion into the batch (the client's own
view of a stream is distorted by how the threads are scheduled on a busy
machine); the bytes the server's prompt store holds after the request are
its ``mlx-knorm: prompt cache`` line.

The two sides alternate in rounds, the order swapping each round, after an
untimed warm-up round, in one warm process (no buffer-cache clearing);
medians over rounds; minor page faults per call next to each figure. Each
round's prompt is a different ``--prompt``-token slice of English prose
(``pydoc_data.topics``), the same for both sides.

``--compare kv-bits``: instead, ``mlx-knorm generate`` with the eviction
cache and with the full cache (the model's own ``KVCache`` per layer), each
with float rows and at ``--kv-bits`` 8 and 4 (``--kv-group-size 64``,
``--quantized-kv-start 0``; mlx-lm turns ``KVCache`` into its
``QuantizedKVCache``): the KV bytes each holds at the end (the command's KV
memory line), peak memory, decode tokens/s, the same rounds.
``--compare draft``: greedy ``mlx-knorm generate`` with the eviction cache,
without a draft model and with each of ``--draft-model`` (default: the
model itself) and, with ``--draft-bits N``, the model's weights rounded
through ``mx.quantize`` at N bits and kept in their dtype (a weaker draft as
fast as the target), ``--num-draft-tokens`` each: decode tokens/s, the
share of generated tokens that were accepted drafts, and whether the text
is the text without a draft (it must be).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import re
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache

from mlx_knorm import __version__
from mlx_knorm.backend import backend_info
from mlx_knorm.bench.cache_report import package_version
from mlx_knorm.bench.cli import run_program
from mlx_knorm.bench.report import machine, markdown_table, now, verdict
from mlx_knorm.bench.server_process import ServerProcess
from mlx_knorm.bench.timing import minor_faults, warm_up
from mlx_knorm.commands import generate as generate_command
from mlx_knorm.commands import server as server_command
from mlx_knorm.commands.loading import load_model, model_cache
from mlx_knorm.commands.memory import parse_kv_memory_lines
from mlx_knorm.quality import MODEL_DIR

SIDES = ("mlx-knorm", "RotatingKVCache")
MIN_TOKENS_PER_S_RATIO = 0.95
MAX_PEAK_MEMORY_RATIO = 1.05
START_TIMEOUT_S = 600
REQUEST_TIMEOUT_S = 3600


def rotating_cache(model, config) -> list:
    """What ``make_prompt_cache(model, max_kv_size=budget)`` builds for a model
    without its own ``make_cache``."""
    return [RotatingKVCache(max_size=config.budget, keep=4) for _ in model.layers]


FACTORIES = {"mlx-knorm": None, "RotatingKVCache": rotating_cache}


def prompts(model: str, tokens: int, count: int) -> list[str]:
    """``count`` texts of about ``tokens`` tokens each, different slices of one prose text."""
    import pydoc_data.topics

    _, tokenizer = load_model(model)[:2]
    ids = tokenizer.encode("\n\n".join(pydoc_data.topics.topics.values()), add_special_tokens=False)
    if len(ids) < tokens * count:
        ids = ids * -(-tokens * count // len(ids))
    texts = [tokenizer.decode(ids[i * tokens:(i + 1) * tokens]) for i in range(count)]
    del tokenizer
    gc.collect()
    return texts


# -- generate ---------------------------------------------------------------

STAT = re.compile(r"^(Prompt|Generation): (\d+) tokens, ([0-9.]+) tokens-per-sec", re.M)


def generate_once(side: str, args, prompt: str, max_tokens: int) -> dict:
    result = generate_text(args, prompt, max_tokens, [], FACTORIES[side])
    del result["text"]
    return result


# -- kv-bits and draft models ------------------------------------------------

def full_cache(model, config) -> list:
    """The model's own cache, as mlx-lm builds it without us (no eviction)."""
    return model_cache(model)


def generate_text(args, prompt: str, max_tokens: int, flags: list, factory=None) -> dict:
    """``generate_once``'s figures for ``mlx-knorm generate ... *flags``, with
    the text, the KV memory line's bytes, and how many generated tokens were
    accepted drafts (mlx-lm's ``from_draft``)."""
    argv = ["--model", args.model, "--prompt", prompt, "--max-tokens", str(max_tokens),
            "--ignore-chat-template", "--budget", str(args.budget), *flags]
    stream = generate_command.mlx_lm_generate.stream_generate
    drafted = []

    def counting_stream_generate(*a, **k):
        for response in stream(*a, **k):
            drafted.append(response.from_draft)
            yield response

    trim = generate_command.mlx_lm_generate.trim_prompt_cache
    trims = []  # (asked, trimmed), the target's and the draft's in turn (mlx-lm's _rewind_cache)

    def recording_trim_prompt_cache(cache, n):
        trimmed = trim(cache, n)
        trims.append((n, trimmed))
        return trimmed

    out = io.StringIO()
    gc.collect()
    mx.reset_peak_memory()
    faults = minor_faults()
    with contextlib.redirect_stdout(out), contextlib.ExitStack() as stack:
        stack.enter_context(patched_attribute(generate_command.mlx_lm_generate, "stream_generate",
                                              counting_stream_generate))
        stack.enter_context(patched_attribute(generate_command.mlx_lm_generate, "trim_prompt_cache",
                                              recording_trim_prompt_cache))
        status = generate_command.main(argv, cache_factory=factory)
    faults = minor_faults() - faults
    peak = mx.get_peak_memory()
    text = out.getvalue()
    if status != 0:
        raise RuntimeError(f"mlx-knorm generate {' '.join(flags)} exited {status}:\n{text}")
    stats = {name: (int(n), float(tps)) for name, n, tps in STAT.findall(text)}
    [kv] = parse_kv_memory_lines(text)
    return {"prompt_tokens": stats["Prompt"][0], "prompt_tokens_per_s": stats["Prompt"][1],
            "generation_tokens": stats["Generation"][0], "tokens_per_s": stats["Generation"][1],
            "peak_memory_bytes": peak, "faults": faults, "kv_allocated_bytes": kv["allocated_mb"] * 1e6,
            "kv_held_bytes": kv["held_mb"] * 1e6, "kv_full_bytes": kv["full_mb"] * 1e6, "accepted_drafts": sum(drafted),
            "drafted": drafted_tokens(drafted, args.num_draft_tokens) if "--draft-model" in flags else 0,
            "target_trims": trim_counts(trims[0::2]), "draft_trims": trim_counts(trims[1::2]),
            "text": text.split("==========")[1]}


def trim_counts(trims: list[tuple[int, int]]) -> dict:
    """Trims asked for (of at least one token), and how many of them the cache refused."""
    asked = [(n, done) for n, done in trims if n > 0]
    return {"asked": len(asked), "refused": sum(done == 0 for _, done in asked)}


def drafted_tokens(from_draft: list[bool], num_draft: int) -> int:
    """Draft tokens proposed, from the ``from_draft`` flags of the tokens
    generated: mlx-lm's loop proposes ``min(left, num_draft)`` each round and
    yields the accepted ones, then the target's token (``from_draft`` False)."""
    proposed, position, total = 0, 0, len(from_draft)
    while position < total:
        proposed += min(total - position, num_draft)
        while position < total and from_draft[position]:
            position += 1
        position += 1
    return proposed


@contextlib.contextmanager
def patched_attribute(owner, name: str, value):
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)


def weakened_copy(model: str, bits: int, out_dir: Path) -> Path:
    """A copy of the mlx-lm model directory ``model`` whose 2-D weights went
    through ``mx.quantize`` at ``bits`` (group 64) and back, kept in their
    dtype: a draft that disagrees with the model now and then, at its speed."""
    import shutil

    source = Path(model)
    if not source.is_dir():
        raise SystemExit(f"bench/commands.py: --draft-bits needs a model directory, got {model}")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    shutil.copytree(source, out_dir)
    for shard in sorted(out_dir.glob("*.safetensors")):
        weights, metadata = mx.load(str(shard), return_metadata=True)
        for name, w in weights.items():
            if name.endswith(".weight") and w.ndim == 2 and w.shape[-1] % 64 == 0 and mx.issubdtype(
                    w.dtype, mx.floating):
                weights[name] = mx.dequantize(*mx.quantize(w, group_size=64, bits=bits), group_size=64,
                                              bits=bits).astype(w.dtype)
        mx.save_safetensors(str(shard), weights, metadata)
    return out_dir


KV_BITS_CASES = {f"{cache} {rows}": (factory, flags)
                 for cache, factory in (("eviction", None), ("full", full_cache))
                 for rows, flags in (("float", []),
                                     ("8-bit", ["--kv-bits", "8", "--kv-group-size", "64",
                                                "--quantized-kv-start", "0"]),
                                     ("4-bit", ["--kv-bits", "4", "--kv-group-size", "64",
                                                "--quantized-kv-start", "0"]))}


def rotated(run, cases: dict, texts: list[str], args) -> dict:
    """``run(case, prompt, max_tokens)`` for every case: a warm-up call each,
    cut short, then ``args.rounds`` rounds, one text each, the order of the
    cases rotating by one each round."""
    names = list(cases)
    for name in names:
        run(name, texts[-1][: len(texts[-1]) // 8], 8)
    results = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            print(f"  round {r + 1}/{args.rounds}: {name}", file=sys.stderr)
            results[name].append(run(name, texts[r], args.tokens))
    return results


def kv_bits_report(args, texts) -> dict:
    results = rotated(lambda name, prompt, n: generate_text(args, prompt, n, KV_BITS_CASES[name][1],
                                                            KV_BITS_CASES[name][0]),
                      KV_BITS_CASES, texts, args)
    cases = {name: summarize(runs) for name, runs in results.items()}
    for name, summary in cases.items():
        for field in ("kv_allocated_bytes", "kv_held_bytes"):
            summary[field] = statistics.median(r[field] for r in results[name])
    base = cases["eviction float"]
    full = cases["full float"]
    for summary in cases.values():
        summary["kv_vs_eviction_float"] = summary["kv_allocated_bytes"] / base["kv_allocated_bytes"]
        summary["kv_vs_full_float"] = summary["kv_allocated_bytes"] / full["kv_allocated_bytes"]
        summary["peak_vs_full_float"] = summary["peak_memory_bytes"] / full["peak_memory_bytes"]
    for summary in cases.values():
        for r in summary["rounds"]:
            r.pop("text")
    return {"cases": cases}


def draft_report(args, texts) -> dict:
    drafts = {"no draft": None, "self draft": args.draft_model or args.model}
    if args.draft_bits:
        drafts[f"{args.draft_bits}-bit-rounded draft"] = str(
            weakened_copy(args.model, args.draft_bits, Path(args.log_dir) / f"draft-{args.draft_bits}bit"))
    cases = {name: ([] if path is None else
                    ["--draft-model", path, "--num-draft-tokens", str(args.num_draft_tokens)])
             for name, path in drafts.items()}
    results = rotated(lambda name, prompt, n: generate_text(args, prompt, n, cases[name]), cases, texts, args)
    report = {"drafts": drafts, "num_draft_tokens": args.num_draft_tokens, "cases": {}}
    plain = results["no draft"]
    for name, runs in results.items():
        summary = summarize(runs)
        accepted = sum(r["accepted_drafts"] for r in runs)
        summary["from_draft_share"] = accepted / sum(r["generation_tokens"] for r in runs)
        summary["acceptance_rate"] = accepted / max(1, sum(r["drafted"] for r in runs))
        for part in ("target_trims", "draft_trims"):
            summary[part] = {k: sum(r[part][k] for r in runs) for k in ("asked", "refused")}
        summary["same_text_as_no_draft"] = all(r["text"] == p["text"] for r, p in zip(runs, plain))
        summary["tokens_per_s_vs_no_draft"] = statistics.median(
            r["tokens_per_s"] / p["tokens_per_s"] for r, p in zip(runs, plain))
        report["cases"][name] = summary
    for summary in report["cases"].values():
        for r in summary["rounds"]:
            r.pop("text")
    return report


# -- server -----------------------------------------------------------------

LOGGED = re.compile(r"Prompt: (\d+) tokens, ([0-9.]+) tokens-per-sec; "
                    r"Generation: (\d+) tokens, ([0-9.]+) tokens-per-sec; Peak memory: ([0-9.]+) GB")
STORE = re.compile(r"mlx-knorm: prompt cache: (\d+) sequences, (\d+) bytes")
BATCHED = re.compile(r"mlx-knorm: batching \d+ requests")


class Server(ServerProcess):
    """One side's server (ours, or stock mlx_lm.server through ``serve-baseline``) on a free loopback port."""

    def __init__(self, side: str, args, log_dir: Path):
        command = ([sys.executable, "-m", "mlx_knorm", "server"] if side == "mlx-knorm"
                   else [sys.executable, str(Path(__file__).resolve()), "serve-baseline"])
        super().__init__([*command, "--model", args.model, "--budget", str(args.budget)],
                         log_dir / f"server-{side}.log", start_timeout_s=START_TIMEOUT_S,
                         request_timeout_s=REQUEST_TIMEOUT_S, poll_s=0.5)

    def logged(self, pattern=LOGGED) -> list:
        """Every match of ``pattern`` in the server's log: by default each
        request's statistics."""
        self.log.flush()
        return pattern.findall(self.log_path.read_text())

    def request(self, prompt: str, max_tokens: int) -> dict:
        before = len(self.logged())
        stored, batched = len(self.logged(STORE)), len(self.logged(BATCHED))
        faults = self.faults()
        status, answer = self.post("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "stream": True})
        if status != 200:
            raise RuntimeError(f"the server answered {status}: {answer[:500]!r}")
        deadline = time.monotonic() + 30
        while ((len(self.logged()) <= before or len(self.logged(STORE)) <= stored)
               and time.monotonic() < deadline):
            time.sleep(0.05)
        prompt_tokens, prompt_tps, tokens, tps, peak = self.logged()[-1]
        sequences, store_bytes = self.logged(STORE)[-1]
        return {"prompt_tokens": int(prompt_tokens), "prompt_tokens_per_s": float(prompt_tps),
                "generation_tokens": int(tokens), "tokens_per_s": float(tps),
                "peak_memory_bytes": float(peak) * 1e9, "faults": self.faults() - faults,
                "batched": len(self.logged(BATCHED)) > batched,
                "prompt_store_sequences": int(sequences), "prompt_store_bytes": int(store_bytes)}



# -- rounds and report ------------------------------------------------------

def interleaved(run, texts: list[str], args) -> dict:
    """``run(side, prompt, max_tokens)`` for both sides: an untimed warm-up
    round on the last text, cut short, then ``args.rounds`` rounds, one text
    each, the order swapping each round. No text is a prefix of another, so
    no request continues another's cache."""
    for side in SIDES:
        run(side, texts[-1][: len(texts[-1]) // 8], 8)
    results = {side: [] for side in SIDES}
    for r in range(args.rounds):
        for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
            print(f"  round {r + 1}/{args.rounds}: {side}", file=sys.stderr)
            results[side].append(run(side, texts[r], args.tokens))
    return results


def summarize(runs: list[dict]) -> dict:
    def median(key):
        return statistics.median(r[key] for r in runs)

    speeds = sorted(r["tokens_per_s"] for r in runs)
    quartiles = statistics.quantiles(speeds, n=4, method="inclusive") if len(speeds) > 1 else [speeds[0]] * 3
    return {"tokens_per_s": median("tokens_per_s"), "tokens_per_s_p25": quartiles[0],
            "tokens_per_s_p75": quartiles[2], "peak_memory_bytes": median("peak_memory_bytes"),
            "prompt_tokens": median("prompt_tokens"), "prompt_tokens_per_s": median("prompt_tokens_per_s"),
            "generation_tokens": median("generation_tokens"), "faults_per_call": median("faults"),
            "rounds": runs}


def compare(results: dict) -> dict:
    """Both sides' medians, and the targets judged on the median over rounds
    of each round's ratio: a round's two calls run next to each other, so
    the machine's drift between rounds (minutes apart) cancels."""
    sides = {side: summarize(runs) for side, runs in results.items()}
    pairs = list(zip(results["mlx-knorm"], results["RotatingKVCache"]))
    ratios = {key: [ours[key] / theirs[key] for ours, theirs in pairs]
              for key in ("tokens_per_s", "peak_memory_bytes")}
    speed = statistics.median(ratios["tokens_per_s"])
    memory = statistics.median(ratios["peak_memory_bytes"])
    return {"sides": sides, "round_ratios": ratios, "targets": {
        "tokens_per_s_ratio": verdict(speed, speed >= MIN_TOKENS_PER_S_RATIO, f">= {MIN_TOKENS_PER_S_RATIO:g}"),
        "peak_memory_ratio": verdict(memory, memory <= MAX_PEAK_MEMORY_RATIO, f"<= {MAX_PEAK_MEMORY_RATIO:g}"),
    }}


def run(args) -> dict:
    host, date = machine(), now()
    warm_up()
    texts = prompts(args.model, args.prompt, args.rounds + 1)
    report = {
        "benchmark": "commands", "mlx_knorm_version": __version__, "mlx_version": mx.__version__,
        "mlx_lm_version": package_version("mlx-lm"), "device": str(mx.default_device()),
        "date": date, "command": " ".join(["python bench/commands.py", *args.argv]),
        "machine": host, "backend": backend_info(), "warm_process": True, "model": args.model,
        "prompt_tokens": args.prompt, "decode_tokens": args.tokens, "budget": args.budget,
        "n_sink": 4, "rounds": args.rounds, "compare": args.compare,
    }
    if args.compare == "kv-bits":
        print("generate, --kv-bits", file=sys.stderr)
        report["kv_bits"] = kv_bits_report(args, texts)
        return report
    if args.compare == "draft":
        print("generate, --draft-model", file=sys.stderr)
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        report["draft"] = draft_report(args, texts)
        return report
    print("generate", file=sys.stderr)
    report["generate"] = compare(
        interleaved(lambda side, prompt, n: generate_once(side, args, prompt, n), texts, args))
    if not args.no_server:
        print("server", file=sys.stderr)
        log_dir = Path(args.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        servers = {}
        try:
            for side in SIDES:
                servers[side] = Server(side, args, log_dir)
            serve = interleaved(lambda side, prompt, n: servers[side].request(prompt, n), texts, args)
        finally:
            for s in servers.values():
                s.stop()
        served = {side: {r["batched"] for r in runs} for side, runs in serve.items()}
        if len(set.union(*served.values())) != 1:
            raise RuntimeError(f"the two servers served the requests differently (batched: {served})")
        report["server"] = compare(serve)
        report["server"]["batched"] = served["mlx-knorm"].pop()
    return report


def print_kv_bits(report: dict) -> None:
    print(f"model {report['model']}; prompt {report['prompt_tokens']} tokens, {report['decode_tokens']} "
          f"decoded, budget {report['budget']}; {report['rounds']} rounds, medians")
    header = ["cache", "KV MB allocated", "vs eviction float", "vs full float", "KV MB held", "peak MB",
              "vs full float", "decode tokens/s"]
    rows = [[name, f"{c['kv_allocated_bytes'] / 1e6:.3f}", f"{c['kv_vs_eviction_float']:.3f}x",
             f"{c['kv_vs_full_float']:.3f}x", f"{c['kv_held_bytes'] / 1e6:.3f}",
             f"{c['peak_memory_bytes'] / 1e6:.1f}",
             f"{c['peak_vs_full_float']:.3f}x", f"{c['tokens_per_s']:.4g}"]
            for name, c in report["kv_bits"]["cases"].items()]
    print(markdown_table(header, rows))


def print_draft(report: dict) -> None:
    d = report["draft"]
    print(f"model {report['model']}; prompt {report['prompt_tokens']} tokens, {report['decode_tokens']} "
          f"decoded, budget {report['budget']}, greedy, --num-draft-tokens {d['num_draft_tokens']}; "
          f"{report['rounds']} rounds, medians")
    header = ["draft", "decode tokens/s [p25, p75]", "vs no draft", "drafts accepted",
              "tokens from the draft", "draft trims refused", "target trims refused", "same text"]
    rows = [[name, f"{c['tokens_per_s']:.4g} [{c['tokens_per_s_p25']:.4g}, {c['tokens_per_s_p75']:.4g}]",
             f"{c['tokens_per_s_vs_no_draft']:.3f}x", f"{c['acceptance_rate']:.1%}",
             f"{c['from_draft_share']:.1%}",
             f"{c['draft_trims']['refused']} of {c['draft_trims']['asked']}",
             f"{c['target_trims']['refused']} of {c['target_trims']['asked']}",
             "yes" if c["same_text_as_no_draft"] else "NO"]
            for name, c in d["cases"].items()]
    print(markdown_table(header, rows))


def print_report(report: dict) -> None:
    m = report["machine"]
    print(f"mlx-knorm {report['mlx_knorm_version']} commands on {report['device']}: "
          f"{m['cpu_model'] or m['processor']}, MLX {report['mlx_version']}, "
          f"mlx-lm {report['mlx_lm_version']}, {report['date']}")
    if "kv_bits" in report:
        return print_kv_bits(report)
    if "draft" in report:
        return print_draft(report)
    print(f"model {report['model']}; prompt {report['prompt_tokens']} tokens, "
          f"{report['decode_tokens']} decoded, budget {report['budget']} (RotatingKVCache max_size "
          f"{report['budget']}, keep 4); {report['rounds']} interleaved rounds, medians; "
          "'vs RotatingKVCache' is the median over rounds of each round's ratio.")
    header = ["command", "cache", "decode tokens/s [p25, p75]", "vs RotatingKVCache",
              "peak MB", "vs RotatingKVCache", "prompt tokens/s", "faults/call"]
    rows, targets = [], []
    for part in ("generate", "server"):
        if part not in report:
            continue
        sides, ratios = report[part]["sides"], report[part]["round_ratios"]
        for side, s in sides.items():
            ours = side == "mlx-knorm"
            speed = f"{statistics.median(ratios['tokens_per_s']):.3f}x" if ours else "1"
            memory = f"{statistics.median(ratios['peak_memory_bytes']):.3f}x" if ours else "1"
            rows.append([part, side,
                         f"{s['tokens_per_s']:.4g} [{s['tokens_per_s_p25']:.4g}, {s['tokens_per_s_p75']:.4g}]",
                         speed, f"{s['peak_memory_bytes'] / 1e6:.1f}", memory,
                         f"{s['prompt_tokens_per_s']:.4g}", f"{s['faults_per_call']:.0f}"])
        targets += [(part, name, v) for name, v in report[part]["targets"].items()]
    print(markdown_table(header, rows))
    if "server" in report:
        sides = report["server"]["sides"]
        stores = ", ".join(f"{side} {s['rounds'][-1]['prompt_store_sequences']} caches, "
                           f"{s['rounds'][-1]['prompt_store_bytes'] / 1e6:.1f} MB"
                           for side, s in sides.items())
        print(f"\nserver: {'batched' if report['server'].get('batched') else 'served alone'}; "
              f"prompt store after the last round: {stores}")
    print("\nTargets (this run):")
    for part, name, v in targets:
        print(f"  {part} {name} {v['measured']:.3f} (target {v['target']}): {'met' if v['met'] else 'MISSED'}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve-baseline"]:
        # Batched as mlx-knorm's server batches (see the docstring).
        return server_command.main(argv[1:], cache_factory=rotating_cache)
    parser = argparse.ArgumentParser(prog="bench/commands.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(MODEL_DIR),
                        help="any model mlx-knorm's commands load (default: the shipped byte-level model)")
    parser.add_argument("--quick", action="store_true", help="prompt 1024 tokens, 32 decoded, 3 rounds")
    parser.add_argument("--prompt", type=int, help="prompt tokens (default 4096)")
    parser.add_argument("--tokens", type=int, help="decoded tokens per call (default 128)")
    parser.add_argument("--rounds", type=int, help="timed rounds per side (default 5)")
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--no-server", action="store_true", help="time generate only")
    parser.add_argument("--compare", choices=["rotating", "kv-bits", "draft"], default="rotating",
                        help="rotating: next to RotatingKVCache (default); kv-bits: KV bytes and peak "
                             "memory at --kv-bits 8 and 4, eviction and full cache; draft: speculative "
                             "decoding (generate only)")
    parser.add_argument("--draft-model", help="--compare draft: the draft model (default: --model)")
    parser.add_argument("--draft-bits", type=int,
                        help="--compare draft: also a draft of the model's weights rounded at this many bits")
    parser.add_argument("--num-draft-tokens", type=int, default=3)
    parser.add_argument("--log-dir", default="build/bench-commands", help="the servers' logs")
    parser.add_argument("--json", metavar="PATH", help="write the raw figures as JSON")
    args = parser.parse_args(argv)
    args.argv = argv
    args.prompt = args.prompt or (1024 if args.quick else 4096)
    args.tokens = args.tokens or (32 if args.quick else 128)
    args.rounds = args.rounds or (3 if args.quick else 5)
    if args.tokens < 2 or args.rounds < 1:
        parser.error("--tokens must be at least 2 and --rounds at least 1")
    return run_program("bench/commands.py", args, run, print_report)


if __name__ == "__main__":
    sys.exit(main())

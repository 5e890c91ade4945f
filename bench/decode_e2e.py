"""End-to-end decode, for each prompt cache: mlx-lm's KVCache (no eviction,
for reference), RotatingKVCache(max_size=budget, keep=4), the reference's
L2NormKVCache and ours (make_knorm_cache, layout "slots" and "temporal"), at
each budget, all in one run (README's end-to-end tables). With --kv-bits N,
the quantized caches instead, as mlx-lm's generate_step makes them
(maybe_quantize_kv_cache after each prefill chunk, quantized_kv_start 0,
group size 64): QuantizedKVCache (mlx-lm's KVCache.to_quantized; no bounded
mlx-lm cache quantizes) and ours through L2NormKVCache.to_quantized, both
layouts; ratios then go to QuantizedKVCache.

The model is a random-weight mlx-lm llama with the attention shapes of
Llama-3.2-1B (hidden 2048, 32 query heads, 8 KV heads, head_dim 64; float16
weights, few layers, a small MLP and vocabulary so that it runs on a CPU),
or with --model a real one (anything mlx_knorm.models.load takes: smollm2, a
GGUF file, an mlx-lm model), whose prompt is then the start of Python's
reference documentation (pydoc_data.topics) in its tokenizer.

    python bench/decode_e2e.py --json bench/results/decode-e2e-cpu.json
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
        python bench/decode_e2e.py --model smollm2 --dtype float32 --budgets 512,2048 \
        --json bench/results/decode-e2e-smollm2-cpu.json

Each cache first takes the prompt in chunks of 512 (mlx-lm's
prefill_step_size), then decodes greedily as mlx_lm.generate does: model(y[None],
cache=cache), argmax, mx.eval, one token at a time. All caches stay alive in
one warm process and decode in rounds, a few tokens of each in turn, the
order rotating, so that the machine's drift hits all alike. Reported per
cache: the median ms/token over the tokens after the warm-up, tokens/s
(1000 / that median), the median CPU time of the process per token (every
thread's; on a machine shared with other work it moves less than wall time
does), the peak memory of its prefill and of its decode, and minor page
faults per token. Ours is make_knorm_cache as a user calls it, so with its
default recent window (recorded as our_recent). With --scorers, ours also
ranking by each scorer named (docs/spec.md §2a; layout "slots"), its
tokens/s against RotatingKVCache's and against ours with the key norm.

Peak memory: mx.reset_peak_memory() before each cache's prefill and before
each of its decode rounds. The memory active at a reset holds the weights,
the other caches and, in decode, the cache's own state; the peak of the
cache's run counts the weights, the cache's own state and the most that
mx.get_peak_memory() rose above the memory active at a reset, so the other
caches, alive only for the interleaving, are left out.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache

from mlx_knorm import __version__
from mlx_knorm.backend import backend_info
from mlx_knorm.bench.cache_report import package_version
from mlx_knorm.bench.cache_step import cache_kinds, stored_arrays
from mlx_knorm.bench.cases import N_SINK
from mlx_knorm.bench.cli import run_program
from mlx_knorm.bench.report import machine, markdown_table, now, verdict
from mlx_knorm.bench.timing import minor_faults, summary, warm_up
from mlx_knorm.cache import make_knorm_cache
from mlx_knorm.defaults import DEFAULT_KV_GROUP_SIZE, default_recent
from mlx_knorm.scorers import default_filters_path

BUDGETS, PREFILL_STEP = (512,), 512
# Targets for our cache against the baseline, checked in the report:
# RotatingKVCache, or with --kv-bits QuantizedKVCache.
MIN_TOKENS_PER_S_RATIO = 0.95
MIN_QUANTIZED_TOKENS_PER_S_RATIO = 0.9
MAX_PEAK_MEMORY_RATIO = 1.05
# A scorer's decode against RotatingKVCache's and against the key norm's.
MIN_SCORER_RATIO = 0.97


def build_model(layers: int, intermediate: int, vocab: int) -> llama.Model:
    args = llama.ModelArgs(
        model_type="llama", hidden_size=2048, num_hidden_layers=layers,
        intermediate_size=intermediate, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, rms_norm_eps=1e-5, vocab_size=vocab, rope_theta=500000.0,
        tie_word_embeddings=True,
    )
    mx.random.seed(0)
    model = llama.Model(args)
    model.set_dtype(mx.float16)
    mx.eval(model.parameters())
    return model


def load_model(args):
    """``(model, description, prompt)``: the random-weight llama, or ``--model`` with a prompt of real text."""
    if args.model is None:
        model = build_model(args.layers, args.intermediate, args.vocab)
        prompt = mx.random.randint(0, args.vocab, (args.prompt,), key=mx.random.key(1))
        description = {"name": "random-weight llama", "hidden_size": 2048, "num_attention_heads": 32,
                       "num_key_value_heads": 8, "head_dim": 64, "num_hidden_layers": args.layers,
                       "intermediate_size": args.intermediate, "vocab_size": args.vocab, "dtype": "float16"}
        return model, description, prompt, "random token ids"
    from mlx_knorm.models import load
    from mlx_knorm.quality.data import pydoc_topics

    model, tokenizer, config = load(args.model, dtype=args.dtype, return_config=True)
    ids = tokenizer.encode(pydoc_topics()[: 8 * args.prompt], add_special_tokens=False)
    if len(ids) < args.prompt:
        raise SystemExit(f"bench/decode_e2e.py: the prompt text has {len(ids)} tokens, {args.prompt} needed")
    dtypes = sorted({str(v.dtype).removeprefix("mlx.core.") for _, v in tree_flatten(model.parameters())})
    description = {"name": args.model, "dtype": args.dtype or "as stored", "parameter_dtypes": dtypes,
                   **{k: config.get(k) for k in ("model_type", "hidden_size", "num_attention_heads",
                                                  "num_key_value_heads", "head_dim", "num_hidden_layers",
                                                  "intermediate_size", "vocab_size")}}
    return model, description, mx.array(ids[: args.prompt]), "pydoc_data.topics, sorted by topic"


def prompt_caches(model, budgets, kv_bits=None, scorers=(), filters=None) -> dict:
    """(budget, name) -> make(): a fresh prompt cache (one cache per layer) of each kind
    that the cache-step benchmark times, at each budget; ours as a user builds it.
    KVCache keeps everything: one, listed under every budget. With ``kv_bits``:
    KVCache (to become QuantizedKVCache) and ours, quantized in the prefill."""
    layers = range(len(model.layers))
    kinds = {}
    if kv_bits is not None:
        for budget in budgets:
            if budget == budgets[0]:
                kinds[(budget, "QuantizedKVCache")] = lambda: [KVCache() for _ in layers]
            for layout in ("slots", "temporal"):
                kinds[(budget, layout)] = lambda layout=layout, budget=budget: make_knorm_cache(
                    model, budget=budget, n_sink=N_SINK, layout=layout)
        return kinds
    for budget in budgets:
        for name, make in cache_kinds().items():
            if name == "KVCache" and budget != budgets[0]:
                continue
            kinds[(budget, name)] = lambda make=make, budget=budget: [make(budget) for _ in layers]
        for layout in ("slots", "temporal"):
            kinds[(budget, layout)] = lambda layout=layout, budget=budget: make_knorm_cache(
                model, budget=budget, n_sink=N_SINK, layout=layout)
        for scorer in scorers:
            kinds[(budget, scorer)] = lambda scorer=scorer, budget=budget: make_knorm_cache(
                model, budget=budget, n_sink=N_SINK, scorer=scorer,
                filters=filters if scorer == "qfilter" else None)
    return kinds


class Decoder:
    """One prompt cache: its prefill, then greedy decode a round at a time."""

    def __init__(self, model, cache, kv_bits=None):
        self.model, self.cache, self.kv_bits = model, cache, kv_bits
        self.samples, self.cpu_samples, self.faults = [], [], 0
        self.prefill_peak = self.decode_peak = 0

    def _rise(self, run) -> int:
        """The most the active memory rose above its level at the start of ``run``."""
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        run()
        return mx.get_peak_memory() - base

    def prefill(self, prompt: mx.array) -> None:
        def run():
            for start in range(0, prompt.size - 1, PREFILL_STEP):
                self.model(prompt[None, start : min(start + PREFILL_STEP, prompt.size - 1)],
                           cache=self.cache)
                maybe_quantize_kv_cache(self.cache, 0, DEFAULT_KV_GROUP_SIZE, self.kv_bits)
                mx.eval([stored_arrays(c) for c in self.cache])

        self.prefill_peak = self._rise(run)
        self.token = prompt[-1:]

    def decode(self, count: int, timed: bool) -> None:
        def run():
            faults = minor_faults()
            for _ in range(count):
                t0, c0 = time.perf_counter(), time.process_time()
                logits = self.model(self.token[None], cache=self.cache)
                self.token = mx.argmax(logits[:, -1, :], axis=-1)
                mx.eval(self.token)
                if timed:
                    self.samples.append(time.perf_counter() - t0)
                    self.cpu_samples.append(time.process_time() - c0)
            if timed:
                self.faults += minor_faults() - faults

        held = sum(x.nbytes for c in self.cache for _, x in tree_flatten(stored_arrays(c)))
        rise = self._rise(run)
        if timed:
            self.decode_peak = max(self.decode_peak, held + rise)


def run(args) -> dict:
    host, date = machine(), now()
    mx.set_default_device(mx.cpu)
    warm_up()
    model, description, prompt, prompt_source = load_model(args)
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    decoders = {}
    filters = None
    if "qfilter" in args.scorers:
        filters = args.filters or default_filters_path(args.model or "")
    for key, make in prompt_caches(model, args.budgets, args.kv_bits, args.scorers, filters).items():
        print(f"prefill {args.prompt} tokens: {key[1]} at budget {key[0]}", file=sys.stderr)
        decoders[key] = Decoder(model, make(), args.kv_bits)
        decoders[key].prefill(prompt)
    names = list(decoders)
    for name in names:
        decoders[name].decode(args.warmup, timed=False)
    rounds = -(-args.tokens // args.round_tokens)
    for r in range(rounds):
        print(f"decode round {r + 1}/{rounds}", file=sys.stderr)
        for name in names[r % len(names):] + names[: r % len(names)]:
            decoders[name].decode(args.round_tokens, timed=True)
    measured = {}
    for key, d in decoders.items():
        timing = summary(d.samples, d.faults)
        measured[key] = {
            **timing,
            "tokens_per_s": 1e3 / timing["median_ms"],
            "cpu_median_ms": summary(d.cpu_samples, 0)["median_ms"],
            "peak_memory_bytes": weights + max(d.prefill_peak, d.decode_peak),
            "prefill_peak_memory_bytes": weights + d.prefill_peak,
            "decode_peak_memory_bytes": weights + d.decode_peak,
            "layer_cache_types": sorted({type(c).__name__ for c in d.cache}),
        }
    baseline, slug, unbounded = baseline_of(args.kv_bits)
    per_budget = {}
    for budget in args.budgets:
        caches = {name: dict(c) for (b, name), c in measured.items() if b == budget or name == unbounded}
        base = caches[baseline]
        for c in caches.values():
            c[f"tokens_per_s_ratio_to_{slug}"] = c["tokens_per_s"] / base["tokens_per_s"]
            c[f"cpu_ms_ratio_to_{slug}"] = c["cpu_median_ms"] / base["cpu_median_ms"]
            c[f"peak_memory_ratio_to_{slug}"] = c["peak_memory_bytes"] / base["peak_memory_bytes"]
        per_budget[str(budget)] = {"caches": caches, "targets": targets(caches, args.kv_bits, args.scorers)}
    return {
        "benchmark": "decode_e2e",
        "mlx_knorm_version": __version__,
        "mlx_version": mx.__version__,
        "mlx_lm_version": package_version("mlx-lm"),
        "reference_version": package_version("veloxquant-mlx"),
        "device": "cpu",
        "date": date,
        "command": " ".join(["python bench/decode_e2e.py", *args.argv]),
        "machine": host,
        "backend": backend_info(),
        "warm_process": True,
        "blas_preload": os.environ.get("LD_PRELOAD") or None,
        "model": {**description, "weights_bytes": weights},
        "prompt_tokens": args.prompt, "prompt_source": prompt_source, "prefill_step_size": PREFILL_STEP,
        "n_sink": N_SINK, "warmup_tokens": args.warmup, "round_tokens": args.round_tokens,
        "kv_bits": args.kv_bits, "kv_group_size": DEFAULT_KV_GROUP_SIZE if args.kv_bits else None,
        "baseline": baseline,
        "our_recent": {str(b): default_recent(b, N_SINK) for b in args.budgets},
        "scorers": list(args.scorers),
        "budgets": per_budget,
    }


def baseline_of(kv_bits) -> tuple[str, str, str]:
    """(the baseline cache, its slug in ratio keys, the cache listed under every budget)."""
    if kv_bits is None:
        return "RotatingKVCache", "rotating", "KVCache"
    return "QuantizedKVCache", "quantized", "QuantizedKVCache"


def targets(caches: dict, kv_bits=None, scorers=()) -> dict:
    """Ours against RotatingKVCache: tokens/s within 5%, peak memory within 5%;
    quantized, against QuantizedKVCache: tokens/s within 10%; each scorer's
    tokens/s within 3% of RotatingKVCache's and of ours with the key norm."""
    slug = baseline_of(kv_bits)[1]
    min_speed = MIN_TOKENS_PER_S_RATIO if kv_bits is None else MIN_QUANTIZED_TOKENS_PER_S_RATIO
    out = {}
    for layout in ("slots", "temporal"):
        c = caches[layout]
        speed, memory = c[f"tokens_per_s_ratio_to_{slug}"], c[f"peak_memory_ratio_to_{slug}"]
        out[f"{layout}_tokens_per_s_ratio"] = verdict(speed, speed >= min_speed, f">= {min_speed:g}")
        if kv_bits is None:
            out[f"{layout}_peak_memory_ratio"] = verdict(
                memory, memory <= MAX_PEAK_MEMORY_RATIO, f"<= {MAX_PEAK_MEMORY_RATIO:g}")
    for scorer in scorers:
        c = caches[scorer]
        speed = c[f"tokens_per_s_ratio_to_{slug}"]
        to_knorm = c["tokens_per_s"] / caches["slots"]["tokens_per_s"]
        out[f"{scorer}_tokens_per_s_ratio"] = verdict(speed, speed >= MIN_SCORER_RATIO, f">= {MIN_SCORER_RATIO:g}")
        out[f"{scorer}_tokens_per_s_ratio_to_knorm"] = verdict(
            to_knorm, to_knorm >= MIN_SCORER_RATIO, f">= {MIN_SCORER_RATIO:g}")
    return out


def print_report(report: dict) -> None:
    m, model = report["machine"], report["model"]
    print(f"mlx-knorm {report['mlx_knorm_version']} decode end to end on cpu: "
          f"{m['cpu_model'] or m['processor']}, MLX {report['mlx_version']}, "
          f"mlx-lm {report['mlx_lm_version']}, {report['date']}, BLAS preload: {report['blas_preload']}")
    print(f"{model['name']} ({model['model_type'] if 'model_type' in model else 'llama'}), hidden "
          f"{model['hidden_size']}, {model['num_attention_heads']}/{model['num_key_value_heads']} heads, "
          f"head_dim {model['head_dim']}, {model['num_hidden_layers']} layers, MLP {model['intermediate_size']}, "
          f"vocab {model['vocab_size']}, {model['dtype']} ({model['weights_bytes'] / 2**20:.0f} MiB of "
          f"weights); prompt {report['prompt_tokens']} tokens ({report['prompt_source']}) in chunks of "
          f"{report['prefill_step_size']}"
          + (f", KV at {report['kv_bits']} bits (group {report['kv_group_size']})" if report["kv_bits"] else "")
          + ". Timed in a warm process, the caches of every budget interleaved "
          "in rounds; medians over the tokens after the warm-up; CPU ms = the process's CPU time per token; "
          "faults/token = minor page faults per token.")
    base, slug, _ = baseline_of(report["kv_bits"])
    header = ["cache", "ms/token [p25, p75]", "tokens/s", f"vs {base}", "CPU ms/token",
              f"CPU vs {base}", "peak MiB",
              f"vs {base}", "prefill / decode peak MiB", "faults/token"]
    for budget, result in report["budgets"].items():
        print(f"\nbudget {budget}:")
        print_table(header, result, slug)


def print_table(header, result: dict, slug: str) -> None:
    rows = []
    for name, c in result["caches"].items():
        rows.append([
            name, f"{c['median_ms']:.4g} [{c['p25_ms']:.4g}, {c['p75_ms']:.4g}]",
            f"{c['tokens_per_s']:.3g}", f"{c[f'tokens_per_s_ratio_to_{slug}']:.3f}x",
            f"{c['cpu_median_ms']:.4g}", f"{c[f'cpu_ms_ratio_to_{slug}']:.3f}x",
            f"{c['peak_memory_bytes'] / 2**20:.1f}", f"{c[f'peak_memory_ratio_to_{slug}']:.3f}x",
            f"{c['prefill_peak_memory_bytes'] / 2**20:.1f} / {c['decode_peak_memory_bytes'] / 2**20:.1f}",
            f"{c['faults_per_call']:.2f}",
        ])
    print(markdown_table(header, rows))
    print("Targets (this run):")
    for name, v in result["targets"].items():
        print(f"  {name} {v['measured']:.3f} (target {v['target']}): {'met' if v['met'] else 'MISSED'}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bench/decode_e2e.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="prompt 1024 tokens, 16 decode tokens")
    parser.add_argument("--prompt", type=int, help="prompt tokens (default 4096)")
    parser.add_argument("--tokens", type=int, help="timed decode tokens per cache (default 96)")
    parser.add_argument("--warmup", type=int, default=4, help="untimed decode tokens first")
    parser.add_argument("--round-tokens", type=int, default=8, help="tokens per cache and round")
    parser.add_argument("--budgets", type=lambda t: [int(v) for v in t.split(",")], default=list(BUDGETS),
                        help="cache budgets, comma-separated (default 512)")
    parser.add_argument("--model", help="a real model instead of the random-weight llama: smollm2, a GGUF "
                                        "file, an mlx-lm model directory or repo")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                        help="--model GGUF files: every weight in this float type (float32 for a CPU "
                             "with OpenBLAS preloaded)")
    parser.add_argument("--layers", type=int, default=2, help="random-weight llama: layers")
    parser.add_argument("--intermediate", type=int, default=512, help="random-weight llama: MLP width")
    parser.add_argument("--vocab", type=int, default=1024, help="random-weight llama: vocabulary")
    parser.add_argument("--kv-bits", type=int, choices=[2, 3, 4, 6, 8],
                        help="quantized caches instead: QuantizedKVCache and ours at these bits")
    parser.add_argument("--scorers", type=lambda t: [v for v in t.split(",") if v], default=[],
                        help="ours ranking by these scorers too, comma-separated (keydiff, vnorm, qfilter)")
    parser.add_argument("--filters", help="qfilter's query filters (default: where mlx-knorm calibrate "
                                          "writes them for --model)")
    parser.add_argument("--json", metavar="PATH", help="write the raw figures as JSON")
    args = parser.parse_args(argv)
    if set(args.scorers) - {"keydiff", "vnorm", "qfilter"}:
        parser.error(f"--scorers takes keydiff, vnorm and qfilter, got {args.scorers}")
    args.argv = sys.argv[1:] if argv is None else list(argv)
    args.prompt = args.prompt or (1024 if args.quick else 4096)
    args.tokens = args.tokens or (16 if args.quick else 96)
    if args.prompt < 2:
        parser.error("--prompt must be at least 2 tokens")
    if not args.budgets or min(args.budgets) <= N_SINK:
        parser.error(f"--budgets must be above n_sink ({N_SINK})")
    return run_program("bench/decode_e2e.py", args, run, print_report)


if __name__ == "__main__":
    sys.exit(main())

"""Batched greedy decode with eviction: ``BatchL2NormKVCache`` (what
``L2NormKVCache.merge`` gives mlx-lm's ``BatchGenerator`` and server) next to
mlx-lm's ``BatchRotatingKVCache`` of the same size (what a user bounding the
cache of a batch picks today) and ``BatchKVCache`` (no bound, for
reference), at 1, 4 and 8 concurrent sequences, and the same sequences
decoded one at a time with ``L2NormKVCache`` (what a server without batching
does). The model is decode_e2e.py's random-weight llama with Llama-3.2-1B's
attention shapes (random prompts), or with ``--model`` a real one (a GGUF
file or a packaged name: ``smollm2`` is SmolLM2-135M-Instruct; prompts of
English prose from ``pydoc_data.topics``); float32 weights either way (set
``LD_PRELOAD`` to OpenBLAS, see the developers' guide, for a CPU's real
speed); budget 512 (``n_sink=4``).

    python bench/batch_decode.py --json bench/results/batch-decode-cpu.json
    python bench/batch_decode.py --model smollm2 --json bench/results/batch-decode-cpu-smollm2.json

Each sequence has its own prompt, lengths spread over ``--prompt-min`` to
``--prompt-max`` (default 1024 to 4096). Each prompt is prefilled once,
through the model with a full ``KVCache`` in chunks of 512, and each cache
kind then takes that prefill's keys and values layer by layer in the same
chunks (so the prefill runs once per prompt, not once per kind; every cache
then holds the state of its own kind, its own row count and layout). The
batch of each kind is the ``merge`` of its sequences' caches, as mlx-lm's
``BatchGenerator`` merges prompt caches; every kind then decodes greedily,
``model(tokens[B, 1], cache=batch)``, argmax, ``mx.eval``, one step at a
time. One-at-a-time decodes each sequence in turn, one token each, and its
step is one token of every sequence. All batches stay alive in one warm
process and decode in rounds, a few steps of each in turn, the order
rotating, after untimed warm-up steps. Reported per kind and batch size:
the median ms per step, decode throughput (tokens/s summed over the
sequences: B / median), peak memory (the weights, the kind's own state and
the most the active memory rose above it during its decode rounds, as
decode_e2e.py measures it) and minor page faults per step; ratios to
``BatchRotatingKVCache`` at the same batch size are per round, medians over
rounds.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, RotatingKVCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_e2e import build_model  # noqa: E402

from mlx_knorm import __version__  # noqa: E402
from mlx_knorm.backend import backend_info  # noqa: E402
from mlx_knorm.bench.cache_report import package_version  # noqa: E402
from mlx_knorm.bench.cases import N_SINK  # noqa: E402
from mlx_knorm.bench.cli import run_program  # noqa: E402
from mlx_knorm.bench.report import machine, markdown_table, now, verdict  # noqa: E402
from mlx_knorm.bench.timing import minor_faults, summary, warm_up  # noqa: E402
from mlx_knorm.cache import make_knorm_cache  # noqa: E402

PREFILL_STEP = 512
BATCH_SIZES = (1, 4, 8)
ROTATING = "BatchRotatingKVCache"
OURS = "BatchL2NormKVCache"
ALONE = "L2NormKVCache one at a time"
# The targets, checked in the report.
MIN_TOKENS_PER_S_RATIO = 0.9
MAX_PEAK_MEMORY_RATIO = 1.05
MIN_SPEEDUP_OVER_ALONE = 1.5
SPEEDUP_BATCH = 4


def single_caches(model, budget: int) -> dict:
    """kind -> make(): one sequence's prompt cache of that kind."""
    layers = range(len(model.layers))
    return {
        "BatchKVCache": lambda: [KVCache() for _ in layers],
        ROTATING: lambda: [RotatingKVCache(max_size=budget, keep=N_SINK) for _ in layers],
        OURS: lambda: make_knorm_cache(model, budget=budget, n_sink=N_SINK),
    }


def prefill(model, prompt: mx.array) -> list[tuple[mx.array, mx.array]]:
    """Each layer's keys and values of ``prompt[:-1]`` (a full-attention prefill)."""
    cache = [KVCache() for _ in model.layers]
    for start in range(0, prompt.size - 1, PREFILL_STEP):
        model(prompt[None, start : min(start + PREFILL_STEP, prompt.size - 1)], cache=cache)
        mx.eval([c.state for c in cache])
    return [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in cache]


def fill(cache: list, rows: list[tuple[mx.array, mx.array]]) -> list:
    """``cache`` fed each layer's rows in prefill chunks, as the model feeds them."""
    for layer, (keys, values) in zip(cache, rows):
        for start in range(0, keys.shape[2], PREFILL_STEP):
            layer.update_and_fetch(keys[:, :, start : start + PREFILL_STEP],
                                   values[:, :, start : start + PREFILL_STEP])
        mx.eval([x for _, x in tree_flatten(layer.state) if isinstance(x, mx.array)])
    return cache


def held_bytes(cache: list) -> int:
    return sum(c.nbytes for c in cache)


class Decoder:
    """One kind at one batch size: a merged batch (or single caches decoded in turn)."""

    def __init__(self, model, caches: list[list], batched: bool, last_tokens: list[int]):
        self.model, self.batched = model, batched
        if batched:
            # Layer by layer, as mlx-lm's BatchGenerator merges prompt caches.
            self.caches = [[layers[0].merge(list(layers)) for layers in zip(*caches)]]
            self.tokens = [mx.array(last_tokens)]
        else:
            self.caches = caches
            self.tokens = [mx.array([t]) for t in last_tokens]
        self.sequences = len(last_tokens)
        self.samples, self.faults, self.peak = [], 0, 0

    def step(self) -> None:
        for i, cache in enumerate(self.caches):
            logits = self.model(self.tokens[i][:, None], cache=cache)
            self.tokens[i] = mx.argmax(logits[:, -1, :], axis=-1)
        mx.eval(self.tokens)

    def decode(self, count: int, timed: bool) -> list[float]:
        held = sum(held_bytes(c) for c in self.caches)
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        faults = minor_faults()
        samples = []
        for _ in range(count):
            t0 = time.perf_counter()
            self.step()
            samples.append(time.perf_counter() - t0)
        if timed:
            self.faults += minor_faults() - faults
            self.samples += samples
            self.peak = max(self.peak, held + mx.get_peak_memory() - base)
        return samples


def real_model(name: str, stride: int):
    """A real model in float32 and its prompts: disjoint slices of English
    prose, ``stride`` tokens apart."""
    import pydoc_data.topics

    from mlx_knorm.models import load

    model, tokenizer = load(name, dtype="float32")
    ids = tokenizer.encode("\n\n".join(pydoc_data.topics.topics.values()))

    def prompt(index: int, n: int) -> mx.array:
        return mx.array(ids[index * stride : index * stride + n])

    return model, prompt


def describe(model) -> dict:
    args = model.args
    return {name: getattr(args, name, None) for name in (
        "model_type", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "num_hidden_layers", "intermediate_size", "vocab_size")}


def prompt_lengths(args) -> list[int]:
    n = max(BATCH_SIZES)
    return [round(args.prompt_min + (args.prompt_max - args.prompt_min) * i / (n - 1)) for i in range(n)]


def run(args) -> dict:
    host, date = machine(), now()
    mx.set_default_device(mx.cpu)
    warm_up()
    if args.model:
        model, make_prompt = real_model(args.model, args.prompt_max)
    else:
        model = build_model(args.layers, args.intermediate, args.vocab)
        model.set_dtype(mx.float32)

        def make_prompt(index: int, n: int) -> mx.array:
            return mx.random.randint(0, args.vocab, (n,), key=mx.random.key(index))

    mx.eval(model.parameters())
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    lengths = prompt_lengths(args)
    # Interleave the lengths so that every batch size holds short and long prompts.
    order = sorted(range(len(lengths)), key=lambda i: (i % 2, i))
    lengths = [lengths[i] for i in order]
    makers = single_caches(model, args.budget)
    singles = {kind: [] for kind in makers}
    last_tokens = []
    for index, n in enumerate(lengths):
        print(f"prefill prompt {index + 1}/{len(lengths)}: {n} tokens", file=sys.stderr)
        prompt = make_prompt(index, n)
        rows = prefill(model, prompt)
        last_tokens.append(prompt[-1].item())
        for kind, make in makers.items():
            singles[kind].append(fill(make(), rows))
    decoders = {}
    for batch in BATCH_SIZES:
        for kind in makers:
            decoders[(kind, batch)] = Decoder(model, copy.deepcopy(singles[kind][:batch]), True,
                                              last_tokens[:batch])
        if batch > 1:
            decoders[(ALONE, batch)] = Decoder(model, copy.deepcopy(singles[OURS][:batch]), False,
                                               last_tokens[:batch])
    names = list(decoders)
    for name in names:
        decoders[name].decode(args.warmup, timed=False)
    per_round = {name: [] for name in names}
    for r in range(args.rounds):
        print(f"decode round {r + 1}/{args.rounds}", file=sys.stderr)
        for name in names[r % len(names):] + names[: r % len(names)]:
            per_round[name].append(statistics.median(decoders[name].decode(args.round_steps, timed=True)))
    results = {}
    for (kind, batch), d in decoders.items():
        timing = summary(d.samples, d.faults)
        results.setdefault(str(batch), {})[kind] = {
            **timing, "sequences": batch,
            "tokens_per_s": batch * 1e3 / timing["median_ms"],
            "peak_memory_bytes": weights + d.peak,
        }
    for batch in BATCH_SIZES:
        row = results[str(batch)]
        rotating = per_round[(ROTATING, batch)]
        for kind, c in row.items():
            # A step's time ratio per round, inverted: tokens/s over the rotating cache's.
            c["tokens_per_s_ratio_to_rotating"] = statistics.median(
                b / a for a, b in zip(per_round[(kind, batch)], rotating))
            c["peak_memory_ratio_to_rotating"] = c["peak_memory_bytes"] / row[ROTATING]["peak_memory_bytes"]
        if batch > 1:
            row[OURS]["tokens_per_s_ratio_to_one_at_a_time"] = statistics.median(
                b / a for a, b in zip(per_round[(OURS, batch)], per_round[(ALONE, batch)]))
    return {
        "benchmark": "batch_decode",
        "mlx_knorm_version": __version__,
        "mlx_version": mx.__version__,
        "mlx_lm_version": package_version("mlx-lm"),
        "device": "cpu",
        "date": date,
        "command": " ".join(["python bench/batch_decode.py", *args.argv]),
        "machine": host,
        "backend": backend_info(),
        "warm_process": True,
        "model": {"name": args.model or "random llama (decode_e2e.py)", **describe(model),
                  "dtype": "float32", "weights_bytes": weights},
        "prompt_tokens": lengths, "prefill_step_size": PREFILL_STEP, "budget": args.budget,
        "n_sink": N_SINK, "warmup_steps": args.warmup, "round_steps": args.round_steps,
        "rounds": args.rounds,
        "batches": results,
        "targets": targets(results),
    }


def targets(results: dict) -> dict:
    out = {}
    for batch, row in results.items():
        ours = row[OURS]
        speed, memory = ours["tokens_per_s_ratio_to_rotating"], ours["peak_memory_ratio_to_rotating"]
        out[f"B{batch}_tokens_per_s_ratio"] = verdict(speed, speed >= MIN_TOKENS_PER_S_RATIO,
                                                      f">= {MIN_TOKENS_PER_S_RATIO:g}")
        out[f"B{batch}_peak_memory_ratio"] = verdict(memory, memory <= MAX_PEAK_MEMORY_RATIO,
                                                     f"<= {MAX_PEAK_MEMORY_RATIO:g}")
    speedup = results[str(SPEEDUP_BATCH)][OURS]["tokens_per_s_ratio_to_one_at_a_time"]
    out[f"B{SPEEDUP_BATCH}_speedup_over_one_at_a_time"] = verdict(
        speedup, speedup >= MIN_SPEEDUP_OVER_ALONE, f">= {MIN_SPEEDUP_OVER_ALONE:g}")
    return out


def print_report(report: dict) -> None:
    m, model = report["machine"], report["model"]
    print(f"mlx-knorm {report['mlx_knorm_version']} batched decode on cpu: "
          f"{m['cpu_model'] or m['processor']}, MLX {report['mlx_version']}, "
          f"mlx-lm {report['mlx_lm_version']}, {report['date']}")
    print(f"{model['name']}: {model['model_type']}, hidden {model['hidden_size']}, "
          f"{model['num_attention_heads']}/{model['num_key_value_heads']} heads, head_dim "
          f"{model['head_dim']}, {model['num_hidden_layers']} layers, MLP {model['intermediate_size']}, "
          f"vocab {model['vocab_size']}, float32; prompts "
          f"{report['prompt_tokens']} tokens, budget {report['budget']}. Warm process, every batch "
          "interleaved in rounds; medians; ratios per round to BatchRotatingKVCache at the same B.")
    header = ["B", "cache", "ms/step [p25, p75]", "tokens/s", "vs rotating", "peak MiB", "vs rotating",
              "faults/step"]
    rows = []
    for batch, row in report["batches"].items():
        for kind, c in row.items():
            rows.append([batch, kind, f"{c['median_ms']:.4g} [{c['p25_ms']:.4g}, {c['p75_ms']:.4g}]",
                         f"{c['tokens_per_s']:.3g}", f"{c['tokens_per_s_ratio_to_rotating']:.3f}x",
                         f"{c['peak_memory_bytes'] / 2**20:.1f}", f"{c['peak_memory_ratio_to_rotating']:.3f}x",
                         f"{c['faults_per_call']:.2f}"])
    print(markdown_table(header, rows))
    print("\nTargets (this run):")
    for name, v in report["targets"].items():
        print(f"  {name} {v['measured']:.3f} (target {v['target']}): {'met' if v['met'] else 'MISSED'}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bench/batch_decode.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="prompts 512 to 1024 tokens, 3 rounds")
    parser.add_argument("--prompt-min", type=int, help="shortest prompt (default 1024)")
    parser.add_argument("--prompt-max", type=int, help="longest prompt (default 4096)")
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--rounds", type=int, help="timed rounds (default 5)")
    parser.add_argument("--round-steps", type=int, default=4, help="decode steps per batch and round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed decode steps first")
    parser.add_argument("--model", help="a real model: a GGUF file or a packaged name (smollm2); "
                                        "default decode_e2e.py's random llama")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=512, help="MLP width")
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--json", metavar="PATH", help="write the raw figures as JSON")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    args.prompt_min = args.prompt_min or (512 if args.quick else 1024)
    args.prompt_max = args.prompt_max or (1024 if args.quick else 4096)
    args.rounds = args.rounds or (3 if args.quick else 5)
    if not 2 <= args.prompt_min <= args.prompt_max:
        parser.error("--prompt-min must be at least 2 and at most --prompt-max")
    return run_program("bench/batch_decode.py", args, run, print_report)


if __name__ == "__main__":
    sys.exit(main())

"""Reading the figures README.md and docs/*.md quote out of their results files.

A ``Quote`` is a passage of a page with its figures left as ``{}``; each ``Figure`` is
computed from the results file (or files) it comes from (docs/results/, bench/results/)
and formatted as the page rounds it. ``mismatch`` says why a page does not contain the
passage filled in (whitespace and ``**`` aside); ``…`` in a passage stands for text the
check does not read (an interval, between figures). tests/test_docs_figures.py holds the
quotes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Callable

from mlx_knorm.quality.policies import row_bytes

ROOT = Path(__file__).resolve().parents[1]
EIGHTHS = (128, 256, 512)  # 1/8, 1/4 and 1/2 of the 1024-token windows
# SmolLM2-135M as measured: head dim 64, float32 rows; README's Llama example: bfloat16.
HEAD_DIM, F32, F16 = 64, 4, 2


EQUAL_ROWS = {128: 436, 256: 874}  # float rows: 8-bit rows of the same bytes (budgets 0.4258, 0.8535)


@cache
def results(name: str) -> dict:
    return json.loads((ROOT / name).read_text())


# Figures, each read or computed from one file the way its page does.
def ppl_to_full(name, policy, rows):
    return results(name)["perplexity_ratio_to_full"][f"{policy}@{rows}"]


def ppl(name, policy, rows):
    return results(name)["perplexity"][f"{policy}@{rows}"]


def ppl_to_window(name, policy, rows):
    """The paired ratio's point estimate: the policy's perplexity over the window's on the same windows."""
    return ppl(name, policy, rows) / ppl(name, "window", rows)


def bits_to_float_window(names, policy, rows):
    """An 8-bit policy's perplexity over the float window's at the same bytes, on the same windows."""
    float_run, bits_run = names
    return ppl(bits_run, policy, EQUAL_ROWS[rows]) / ppl(float_run, "window", rows)


def recall(name, policy, rows):
    return results(name)["recall"][f"{policy}@{rows}"]


def spearman(name, layer=None, end=min):
    by_layer = results(name)["layer_spearman"]
    return by_layer[str(layer)] if layer is not None else end(by_layer.values())


def needle(name, haystack, policy, fraction=None, field="accuracy"):
    """A policy's total over every context and depth (``field``: accuracy, correct, trials)."""
    for t in results(name)["totals"]:
        if (t["haystack"], t["policy"], t["budget_fraction"], t["context"]) == (haystack, policy, fraction, "all"):
            return t[field]
    raise KeyError(f"{name}: no total for {haystack} {policy} at {fraction}")


def decode(name, budget, cache_name, field):
    run = results(name)
    caches = run["caches"] if "caches" in run else run["budgets"][str(budget)]["caches"]
    return caches[cache_name][field]


def slots_speed(names, end):
    """The slot layout's tokens/s over RotatingKVCache's, ``end`` (min, max) over the runs and their budgets."""
    return end(b["caches"]["slots"]["tokens_per_s_ratio_to_rotating"]
               for name in names for b in results(name)["budgets"].values())


def target(name, budget, key):
    """A recorded target's bound: ``>= 0.97`` gives 0.97."""
    return float(results(name)["budgets"][str(budget)]["targets"][key]["target"].split()[-1])


def quick(name, label, *path):
    case = next(c for c in results(name)["cases"] if c["label"] == label)
    for key in path:
        case = case[key]
    return case


def cache_step_ratio(name, end):
    """The slot layout's step over RotatingKVCache's, ``end`` (min, max) over the budgets and batches."""
    return end(c["caches"]["slots"]["ratio_to_rotating"] for c in results(name)["configs"])


def batch_speedup(name):
    return results(name)["targets"]["B4_speedup_over_one_at_a_time"]["measured"]


def batch(name, cache_name, field, end, sizes=("1", "4", "8")):
    """A batch cache's ``field`` against BatchRotatingKVCache's, ``end`` (min, max) over the batch sizes."""
    return end(results(name)["batches"][size][cache_name][field] for size in sizes)


def batches(names, field, each, across, sizes=("1", "4", "8")):
    """``BatchKVCache``'s ``field``, ``each`` (min, max) run's over the sizes, ``across`` the runs."""
    return across(batch(name, "BatchKVCache", field, each, sizes) for name in names)


def cache_steps(name, end, ratio):
    """``ratio(caches)`` of each budget and batch, ``end`` (min, max) over them."""
    return end(ratio(c["caches"]) for c in results(name)["configs"])


def to_knorm(name, budget, cache_name):
    """A scorer's tokens/s over the key norm's (ours, slots) in the same run."""
    return decode(name, budget, cache_name, "tokens_per_s") / decode(name, budget, "slots", "tokens_per_s")


def kv_bytes(name, rows, bits=None, eviction=True):
    """``rows`` of the run's context at their bytes (``bits``, or float32), over a full float32 cache's."""
    run = results(name)
    context = run["seq_len"] if "seq_len" in run else run["contexts"][0]
    return rows * row_bytes(HEAD_DIM, F32, bits, eviction) / (context * row_bytes(HEAD_DIM, F32, eviction=False))


def row_share(itemsize, bits, rows=1.0):
    """``rows`` quantized rows' bytes over one float row's of ``itemsize`` bytes an element."""
    return rows * row_bytes(HEAD_DIM, itemsize, bits) / row_bytes(HEAD_DIM, itemsize)


def rows_for_bytes(itemsize):
    """How many 8-bit rows the bytes of one float row hold."""
    return 1 / row_share(itemsize, 8)


# Formats, as the pages round.
def f(spec: str) -> Callable[[float], str]:
    return lambda x: format(x, spec)


def share(x: float) -> str:
    """A needle's share of keys found: ``0`` for none, else two decimals."""
    return "0" if x == 0 else f"{x:.2f}"


def sig(n: int) -> Callable[[float], str]:
    """``n`` significant figures, trailing zeros kept (``19.0``, ``156``)."""
    return lambda x: format(x, f"#.{n}g").rstrip(".")


def trim(n: int) -> Callable[[float], str]:
    """``n`` significant figures, trailing zeros dropped (``84.7``, ``130``), as the benchmark tables print."""
    return lambda x: format(x, f".{n}g")


def minus(spec: str) -> Callable[[float], str]:
    """A typeset sign: ``−0.72``, ``+0.148``."""
    return lambda x: ("−" if x < 0 else "+") + format(abs(x), spec)


def mib(x: float) -> str:
    return f"{x / 2**20:.1f}"


@dataclass(frozen=True)
class Figure:
    value: Callable[[], float]
    fmt: Callable[[float], str]
    files: tuple[str, ...]  # none: computed from the package's code (row_bytes)

    def text(self) -> str:
        return self.fmt(self.value())


def fig(fmt, func, name=None, *args, **kwargs) -> Figure:
    """A figure of ``func(name, *args)``: ``name`` is the results file (or files) it reads, None for none."""
    files = () if name is None else name if isinstance(name, tuple) else (name,)
    return Figure(lambda: func(name, *args, **kwargs) if name is not None else func(*args, **kwargs), fmt, files)


@dataclass(frozen=True)
class Quote:
    page: str
    text: str
    figures: tuple[Figure, ...]
    cited: tuple[str, ...] = ()  # pages that name the files, where the page itself does not

    @property
    def id(self) -> str:
        return f"{self.page}: {self.text[:50]}"


def q(page, text, *figures, cited=()) -> Quote:
    assert text.count("{}") == len(figures), text
    return Quote(page, text, figures, tuple(cited))


def normalized(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("**", ""))


@cache
def page(name: str) -> str:
    return normalized((ROOT / name).read_text())


def pattern(quote: Quote, figures: list[str]) -> re.Pattern:
    """The passage with ``figures`` filled in, each a group; ``…`` matches text within a table cell."""
    parts = [re.escape(part).replace(re.escape("…"), r"[^|·]*?") for part in normalized(quote.text).split("{}")]
    # A figure is a whole number on the page: 0.5 is not read out of 10.5 or 0.55.
    figure = r"(?<![\d.])({})(?!\d)"
    return re.compile(parts[0] + "".join(figure.format(re.escape(value)) + part
                                         for value, part in zip(figures, parts[1:])))


def mismatch(quote: Quote, text: str) -> str | None:
    """Why ``text`` (a normalized page) does not quote the files' figures as ``quote`` says, or None."""
    figures = [figure.text() for figure in quote.figures]
    if pattern(quote, figures).search(text):
        return None
    files = sorted({name for figure in quote.figures for name in figure.files})
    return f"{quote.page} does not say {quote.text.format(*figures)!r}, as {', '.join(files) or 'row_bytes'} give"

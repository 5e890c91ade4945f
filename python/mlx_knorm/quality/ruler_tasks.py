"""RULER's synthetic tasks (Hsieh et al. 2024, arXiv:2404.06654), generated offline with fixed seeds.

Written after the definitions of NVIDIA/RULER's ``scripts/data/synthetic``
and lm-eval's ``ruler`` tasks (the prompt wording is theirs, so that figures
compare; the code is ours):

- ``niah_*``: needles "One of the special magic {numbers|words|uuids} for
  {key} is: {value}." in a haystack, at depths drawn from 40 evenly spaced
  ones; the question asks for the values of one or more keys. Haystacks:
  ``noise`` (RULER's repeated filler), ``essay`` (prose: RULER takes Paul
  Graham's essays, a download; here Python's reference documentation,
  ``pydoc_data.topics``, which every machine has, or a user's text) and
  ``needle`` (the haystack is itself distractor needles).
- ``vt``: variable tracking, one chain of 4 hops in the noise haystack.
- ``cwe``: common words extraction, the 10 words that occur 30 times in a
  numbered list where others occur 3 times.
- ``fwe``: frequent words extraction, the 3 most frequent coded words of
  a Zipf-distributed (alpha 2) text.

Keys and common words come from the ``wonderwords`` package's word lists
(as RULER's do); the QA tasks need downloaded datasets and are left out.
Each prompt is the longest whose tokens, with the task's answer budget,
fit the context (a task whose generator runs out first, as cwe's word list does past
roughly 100k subword tokens, is refused rather than cut short). Scoring is RULER's
``string_match_all``: the share of the expected answers found (case-insensitive) in the model's output.
"""

from __future__ import annotations

import random
import re
import string
import uuid
from dataclasses import dataclass
from functools import lru_cache

NEEDLE = "One of the special magic {kind} for {key} is: {value}."
NIAH_TEMPLATE = ("Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
                 "I will quiz you about the {kind} afterwards.\n{context}\nWhat are all the special magic "
                 "{kind} for {query} mentioned in the provided text?")
NIAH_ANSWER = " The special magic {kind} for {query} mentioned in the provided text are"
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
               "{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.")
VT_ANSWER = (" Answer: According to the chain(s) of variable assignment in the text above, {count} variables "
             "are assigned the value {query}, they are: ")
CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. "
                "Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most common "
                "words in the above list?")
CWE_ANSWER = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please "
                "ignore the dots '....'. What are the three most frequently appeared words in the above coded "
                "text?")
FWE_ANSWER = " Answer: According to the coded text above, the three most frequently appeared words are:"

DEPTHS = tuple(round(100 * i / 39) for i in range(40))  # percent, as RULER's 40 depths


@dataclass(frozen=True)
class NiahSpec:
    haystack: str  # noise, essay or needle
    key_kind: str  # words or uuids
    value_kind: str  # numbers, words or uuids
    keys: int = 1  # needles with distinct keys (the first ``queries`` are asked for, the rest distract)
    values: int = 1  # values per key
    queries: int = 1


NIAH = {
    "niah_single_1": NiahSpec("noise", "words", "numbers"),
    "niah_single_2": NiahSpec("essay", "words", "numbers"),
    "niah_single_3": NiahSpec("essay", "words", "uuids"),
    "niah_multikey_1": NiahSpec("essay", "words", "numbers", keys=4),
    "niah_multikey_2": NiahSpec("needle", "words", "numbers"),
    "niah_multikey_3": NiahSpec("needle", "uuids", "uuids"),
    "niah_multivalue": NiahSpec("essay", "words", "numbers", values=4),
    "niah_multiquery": NiahSpec("essay", "words", "numbers", keys=4, queries=4),
}
# Not in RULER's set: a single needle with a word value (RULER has number and UUID values).
EXTRA_NIAH = {"niah_single_words": NiahSpec("essay", "words", "words")}
# The tasks whose haystack is prose (``haystack_text``'s).
ESSAY_TASKS = tuple(name for name, spec in {**NIAH, **EXTRA_NIAH}.items() if spec.haystack == "essay")
TASKS = (*NIAH, "vt", "cwe", "fwe")  # RULER's synthetic tasks, its average's order
ALL_TASKS = (*TASKS, *EXTRA_NIAH)
# RULER's tokens_to_generate per task.
MAX_TOKENS = {**{name: 128 for name in (*NIAH, *EXTRA_NIAH)}, "vt": 30, "cwe": 120, "fwe": 50}


@dataclass(frozen=True)
class Sample:
    """One prompt of a task: its text (question and answer prefix included), its token ids and answers."""

    task: str
    index: int
    text: str
    tokens: tuple[int, ...]
    answers: tuple[str, ...]
    max_tokens: int


@lru_cache(maxsize=None)
def word_lists() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(adjectives, nouns)`` of the ``wonderwords`` package: one-word lowercase ones, its profanity list
    left out, sorted."""
    try:
        from importlib.resources import files

        assets = files("wonderwords") / "assets"
    except ModuleNotFoundError:
        raise ImportError("the ruler tasks take their words from the wonderwords package: "
                          "pip install 'mlx-knorm[quality]' (or pip install wonderwords)") from None

    def read(name):
        return {w.strip().lower() for w in (assets / name).read_text(encoding="utf-8").splitlines()}

    banned = read("profanitylist.txt")

    def usable(name):
        return tuple(sorted(w for w in read(name) - banned if w.isalpha() and w.isascii()))

    return usable("adjectivelist.txt"), usable("nounlist.txt")


def string_match_all(prediction: str, answers) -> float:
    """RULER's score of one output: the share of ``answers`` it contains, case-insensitive."""
    answers = list(answers)
    if not answers:
        raise ValueError("answers must not be empty")
    text = prediction.lower()
    return sum(a.lower() in text for a in answers) / len(answers)


def essay_sentences(text: str) -> list[str]:
    """``text`` as sentences (whitespace folded), the units an essay haystack is cut in."""
    folded = re.sub(r"\s+", " ", text).strip()
    return [s for s in re.split(r"(?<=[.!?])\s+", folded) if s]


class _Random:
    """The draws of one sample: a ``random.Random`` seeded by (seed, task, index)."""

    def __init__(self, seed: int, task: str, index: int):
        self.rng = random.Random(f"{seed}/{task}/{index}")

    def number(self, digits: int = 7) -> str:
        return str(self.rng.randint(10 ** (digits - 1), 10 ** digits - 1))

    def word(self) -> str:
        adjectives, nouns = word_lists()
        return f"{self.rng.choice(adjectives)}-{self.rng.choice(nouns)}"

    def uuid(self) -> str:
        return str(uuid.UUID(int=self.rng.getrandbits(128), version=4))

    def draw(self, kind: str) -> str:
        return {"numbers": self.number, "words": self.word, "uuids": self.uuid}[kind]()

    def distinct(self, kind: str, count: int, taken=()) -> list[str]:
        out, seen = [], set(taken)
        while len(out) < count:
            value = self.draw(kind)
            if value not in seen:
                seen.add(value)
                out.append(value)
        return out


def _fit(build, tokenizer, context: int, max_tokens: int, limit: int):
    """The largest ``n`` in [1, limit] whose ``build(n)`` text tokenizes within ``context - max_tokens``."""
    room = context - max_tokens

    def size(n):
        return len(tokenizer.encode(build(n)))

    if size(1) > room:
        raise ValueError(f"a context of {context} tokens has no room for the task with {max_tokens} tokens "
                         "to answer in")
    low, high = 1, 1
    while high < limit and size(high) <= room:
        low, high = high, min(2 * high, limit)
    if size(high) <= room:
        return high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if size(middle) <= room else (low, middle)
    return low


def _niah(spec: NiahSpec, r: _Random, units: list[str]) -> tuple:
    """``(build(n), answers)`` of a needle task; ``units``: the essay's words (``n`` of them, or ``n`` noise
    sentences or distractor needles, make its haystack)."""
    keys = r.distinct(spec.key_kind, spec.keys)
    values = [r.distinct(spec.value_kind, spec.values) for _ in keys]
    needles = [NEEDLE.format(kind=spec.value_kind, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
    r.rng.shuffle(needles)
    depths = sorted(r.rng.sample(DEPTHS, len(needles)))
    queried = keys[: spec.queries]
    query = queried[0] if len(queried) == 1 else ", ".join(queried[:-1]) + ", and " + queried[-1]
    answers = tuple(v for vs in values[: spec.queries] for v in vs)
    if spec.haystack == "needle":
        distractor_keys = r.distinct(spec.key_kind, 4096, taken=keys)
        distractors = [NEEDLE.format(kind=spec.value_kind, key=k, value=r.draw(spec.value_kind))
                       for k in distractor_keys]

    def build(n: int) -> str:
        if spec.haystack == "noise":
            filler = [NOISE] * n
        elif spec.haystack == "needle":
            filler = [distractors[i % len(distractors)] for i in range(n)]
        else:  # n words of the essay, cut in sentences (the needles go between two)
            filler = essay_sentences(" ".join(units[i % len(units)] for i in range(n)))
        body = list(filler)
        for offset, (depth, needle) in enumerate(zip(depths, needles)):
            body.insert(round(depth / 100 * len(filler)) + offset, needle)
        context = (" " if spec.haystack == "essay" else "\n" if spec.haystack == "needle" else " ").join(body)
        return (NIAH_TEMPLATE.format(kind=spec.value_kind, context=context, query=query)
                + NIAH_ANSWER.format(kind=spec.value_kind, query=query))

    return build, answers


def _vt(r: _Random) -> tuple:
    names = []
    while len(names) < 5:
        name = "".join(r.rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in names:
            names.append(name)
    value = r.number(5)
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[i]} = VAR {names[i - 1]}" for i in range(1, 5)]
    depths = sorted(r.rng.sample(DEPTHS, len(chain)))

    def build(n: int) -> str:
        body = [NOISE] * n
        for offset, (depth, line) in enumerate(zip(depths, chain)):
            body.insert(round(depth / 100 * n) + offset, line)
        return (VT_TEMPLATE.format(context="\n".join(body), query=value)
                + VT_ANSWER.format(count=len(chain), query=value))

    return build, tuple(names)


# Occurrences of each common word: RULER's 30, fewer where a short context has no room for 300 words.
CWE_COMMON_COUNTS = (30, 10, 6)


def _cwe(r: _Random, common_count: int) -> tuple:
    adjectives, nouns = word_lists()
    words = list(adjectives + nouns)
    pool = r.rng.sample(words, 2000)
    # Past the first 2000, the rest of the list in a drawn order: long contexts take more rare words.
    rest = sorted(set(words) - set(pool))
    r.rng.shuffle(rest)
    common, rare = pool[:10], pool[10:] + rest

    def build(n: int) -> str:
        words = [w for w in common for _ in range(common_count)] + [w for w in rare[:n] for _ in range(3)]
        random.Random(f"{len(words)}/{common[0]}").shuffle(words)
        listed = " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))
        return CWE_TEMPLATE.format(context=listed) + CWE_ANSWER

    return build, tuple(common), len(rare)


def _fwe(r: _Random, words: int) -> tuple:
    vocabulary = []
    while len(vocabulary) < 4096:
        word = "".join(r.rng.choice(string.ascii_lowercase) for _ in range(6))
        if word not in vocabulary:
            vocabulary.append(word)
    # Zipf (alpha 2) ranks, drawn once; a prefix of them is the text at each length.
    weights = [1 / (rank ** 2.0) for rank in range(1, len(vocabulary) + 1)]
    draws = r.rng.choices(range(len(vocabulary)), weights=weights, k=words)  # a prefix is the same at any k
    # The three most frequent ranks are 0, 1, 2 in expectation; the answers are the counted top three.

    def text(n: int) -> tuple[str, tuple[str, ...]]:
        words = [vocabulary[i] for i in draws[:n]]
        counts = {}
        for w in words:
            counts[w] = counts.get(w, 0) + 1
        top = tuple(w for w, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:3])
        return FWE_TEMPLATE.format(context=" .... ".join(words)) + FWE_ANSWER, top

    return (lambda n: text(n)[0]), (lambda n: text(n)[1])


def make_sample(task: str, index: int, tokenizer, context: int, *, seed: int = 0, haystack_text: str | None = None,
                max_tokens: int | None = None) -> Sample:
    """Sample ``index`` of ``task`` at ``context`` tokens; the same arguments give the same sample.

    ``haystack_text``: the essay haystack's text (default: Python's reference documentation).
    """
    if task not in ALL_TASKS:
        raise ValueError(f"task must be one of {', '.join(ALL_TASKS)}, got {task!r}")
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ValueError(f"context must be a positive int, got {context!r}")
    budget = MAX_TOKENS[task] if max_tokens is None else max_tokens
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
    r = _Random(seed, task, index)
    answers_of = None
    # Units (words, sentences, needles, list entries) are a token or more each, so ``limit`` units never
    # bind but where a generator runs out (cwe's word list), which is refused below, not cut short.
    limit = max(1 << 15, 2 * context)
    if task in NIAH or task in EXTRA_NIAH:
        spec = {**NIAH, **EXTRA_NIAH}[task]
        units = (haystack_text if haystack_text is not None else _pydoc()).split() \
            if spec.haystack == "essay" else []
        if spec.haystack == "essay" and not units:
            raise ValueError("the haystack text has no words")
        build, answers = _niah(spec, r, units)
    elif task == "vt":
        build, answers = _vt(r)
    elif task == "cwe":
        for common_count in CWE_COMMON_COUNTS:
            build, answers, limit = _cwe(_Random(seed, task, index), common_count)
            if len(tokenizer.encode(build(1))) <= context - budget or common_count == CWE_COMMON_COUNTS[-1]:
                break
    else:
        build, answers_of = _fwe(r, limit)
    try:
        n = _fit(build, tokenizer, context, budget, limit)
    except ValueError as error:
        raise ValueError(f"{task}: {error}") from None
    if n == limit:
        raise ValueError(f"{task}: its generator runs out at {len(tokenizer.encode(build(n)))} tokens, short of "
                         f"a {context}-token context with {budget} to answer in")
    text = build(n)
    if answers_of is not None:
        answers = answers_of(n)
    tokens = tuple(tokenizer.encode(text))
    return Sample(task, index, text, tokens, tuple(answers), budget)


@lru_cache(maxsize=1)
def _pydoc() -> str:
    from .data import pydoc_topics

    return pydoc_topics()

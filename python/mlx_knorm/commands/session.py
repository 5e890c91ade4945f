"""What the four commands share: the cache's flags on mlx-lm's own parser, the
cache factory installed on every model loaded, and mlx-lm's ``main`` run with
both in place.

A ``Session`` is one run of one command. ``Session.run`` calls the mlx-lm
module's ``main()`` with a few of that module's globals replaced for the
duration of the call (``patched``):

- ``argparse``: a stand-in whose ``ArgumentParser`` adds the cache's flags
  to mlx-lm's parser when it parses, so ``--help`` lists mlx-lm's flags
  (whatever its version defines) and ours, and checks ours;
- ``load`` (and ``sharded_load``): ``loading.load_model``, then
  ``install_cache`` with this session's factory, so every cache mlx-lm
  builds for the model is ``make_knorm_cache(model, ...)``;
- whatever the command itself needs to report memory (its module says).

mlx-lm's ``--kv-bits`` converts these caches as it converts ``KVCache``
(``L2NormKVCache.to_quantized``), and ``--draft-model`` runs speculative
decoding on them (exact trims, exact verify blocks: docs/spec.md §8). A
draft model's cache takes the session's settings without ``skip_layers``:
those are the target's layer indices, and a draft whose trims are refused
must refuse them in every layer alike.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import textwrap
import threading
import types
import weakref
from dataclasses import dataclass, fields, replace
from typing import Callable

from ..cache import EXACT_BLOCK, MAX_DRAFT_TOKENS, make_knorm_cache
from ..defaults import DEFAULT_BUDGET, DEFAULT_KEEP, DEFAULT_LAYOUT, DEFAULT_N_SINK, DEFAULT_RECENT_SHARE, default_recent
from ..ops.evict_and_fill import LAYOUTS, check_layout
from ..scorers import BUILTIN_SCORERS, DEFAULT_SCORER, QueryFilters, default_filters_path
from ..validation import KEEP_CHOICES, check_config, check_int
from .loading import install_cache, load_model

# The cache's settings: CacheConfig's fields, the commands' flags (--n-sink for
# n_sink) and the server's request fields. --filters (a file) is the command
# line's alone: a request names a scorer, not a file to read.
CACHE_FIELDS = ("budget", "n_sink", "recent", "keep", "skip_layers", "layout", "scorer")
# mlx-lm's name for a bounded cache; here the same setting as --budget.
BUDGET_ALIAS = "max_kv_size"


def check_draft_tokens(count, name: str = "num_draft_tokens") -> None:
    """Refuse a draft token count whose verify blocks would not be exact
    (docs/spec.md §8): ``ValueError`` naming ``name``."""
    if isinstance(count, int) and count > MAX_DRAFT_TOKENS:
        raise ValueError(
            f"{name} must be at most {MAX_DRAFT_TOKENS} with eviction caches, got {count}: a verify "
            f"block of more than {EXACT_BLOCK} tokens past the budget attends as one block, not as "
            "single steps, so the output would differ from the output without a draft")


# Why speculative output is exact only without skip_layers (docs/commands.md).
SKIP_LAYERS_WITH_DRAFT = (
    "with --skip-layers the target's layers cannot attend a verify block as single steps "
    "would (its KVCache layers share the block's mask), so once a prompt passes the budget "
    "--draft-model's output can differ from the output without a draft")


class CommandError(Exception):
    """A refusal the command prints as one line (``mlx-knorm NAME: ...``), exit status 1."""


@dataclass(frozen=True)
class CacheConfig:
    """``make_knorm_cache``'s settings, checked on construction (hashable, so
    the server keys its prompt caches by it)."""

    budget: int = DEFAULT_BUDGET
    n_sink: int = DEFAULT_N_SINK
    # None: make_knorm_cache's default window for the budget and n_sink.
    recent: int | None = None
    keep: str = DEFAULT_KEEP
    skip_layers: tuple[int, ...] = ()
    layout: str = DEFAULT_LAYOUT
    scorer: str = DEFAULT_SCORER
    # The qfilter scorer's query filters, read from a `mlx-knorm calibrate` file.
    filters: QueryFilters | None = None

    def __post_init__(self) -> None:
        check_config(self.budget, self.n_sink, self.window, self.keep)
        check_layout(self.layout)
        if self.scorer not in BUILTIN_SCORERS:
            raise ValueError(f"mlx_knorm: scorer must be one of {BUILTIN_SCORERS}, got {self.scorer!r}")
        if not isinstance(self.skip_layers, (tuple, list)):
            raise TypeError(
                f"mlx_knorm: skip_layers must be a list of ints, got {type(self.skip_layers).__name__}")
        object.__setattr__(self, "skip_layers",
                           tuple(check_int(i, "skip_layers entry") for i in self.skip_layers))

    @property
    def window(self) -> int:
        """The recent window the cache protects."""
        if self.recent is None:
            return default_recent(check_int(self.budget, "budget"), check_int(self.n_sink, "n_sink"))
        return self.recent

    def make_cache(self, model) -> list:
        if self.scorer == "qfilter" and self.filters is None:
            raise ValueError("the qfilter scorer needs the model's query filters: run `mlx-knorm calibrate "
                             "--model M` (or give --filters FILE)")
        filters = self.filters if self.scorer == "qfilter" else None
        settings = {field.name: getattr(self, field.name) for field in fields(self)}
        return make_knorm_cache(model, **{**settings, "recent": self.window, "filters": filters})

    def for_draft(self) -> "CacheConfig":
        """The settings of a draft model's cache: no ``skip_layers`` (the
        target's layer indices), and the key norm where the target ranks by
        its own query filters, which the draft's queries do not share."""
        scorer = DEFAULT_SCORER if self.scorer == "qfilter" else self.scorer
        return replace(self, skip_layers=(), scorer=scorer, filters=None)

    def describe(self) -> str:
        skip = ",".join(map(str, self.skip_layers)) or "none"
        return (f"budget {self.budget}, n_sink {self.n_sink}, recent {self.window}, keep {self.keep}, "
                f"skip_layers {skip}, layout {self.layout}, scorer {self.scorer}")


def _layers(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices, got {text!r}") from None


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """The cache's flags, in a group of their own. Their defaults are None so
    that a flag given can be told from one left out; ``resolve_cache_config``
    fills in the defaults shown in the help."""
    group = parser.add_argument_group(
        "L2-norm KV-cache eviction (mlx-knorm)",
        "Each attention layer keeps at most --budget rows per head: the --n-sink first\n"
        "tokens, the --recent latest and, of the rest, those with the lowest key L2 norm\n"
        "(--keep low). Sliding-window and recurrent layers keep the model's own cache.")
    group.add_argument("--budget", type=int, default=None,
                       help=f"rows kept per head in each layer (default: {DEFAULT_BUDGET}); "
                            "--max-kv-size means the same")
    alias = parser._option_string_actions.get("--max-kv-size")
    if alias is None:
        group.add_argument("--max-kv-size", type=int, default=None, help="the same as --budget")
    else:
        alias.help = "the same as --budget"
    group.add_argument("--n-sink", type=int, default=None,
                       help=f"first tokens always kept (default: {DEFAULT_N_SINK})")
    group.add_argument("--recent", type=int, default=None,
                       help=f"latest tokens always kept (default: {DEFAULT_RECENT_SHARE} of the budget, "
                            "fewer where the budget leaves no row to evict)")
    group.add_argument("--keep", choices=KEEP_CHOICES, default=None,
                       help=f"keep the lowest or the highest key norms (default: {DEFAULT_KEEP})")
    group.add_argument("--skip-layers", type=_layers, default=None, metavar="I,J,...",
                       help="layers left uncompressed (a full KVCache), e.g. 0,1 as in the paper "
                            "(default: none)")
    group.add_argument("--layout", choices=LAYOUTS, default=None,
                       help=f"storage order of the kept rows (default: {DEFAULT_LAYOUT}); "
                            "'temporal' keeps temporal order")
    group.add_argument("--scorer", choices=BUILTIN_SCORERS, default=None,
                       help=f"what rows are ranked by (default: {DEFAULT_SCORER}, the key norm; keydiff: "
                            "redundancy with the keys before; vnorm: key over value norm; qfilter: projection "
                            "on the model's query filters, from `mlx-knorm calibrate`); docs/spec.md 2a")
    group.add_argument("--filters", default=None, metavar="FILE",
                       help="the query filters of --scorer qfilter (default: where `mlx-knorm calibrate "
                            "--model M` writes them for this --model)")


def given_cache_settings(namespace: argparse.Namespace) -> dict:
    """The cache settings given on the command line, ``--max-kv-size`` as ``budget``."""
    given = {f: getattr(namespace, f, None) for f in CACHE_FIELDS}
    alias = getattr(namespace, BUDGET_ALIAS, None)
    if given["budget"] is not None and alias is not None and given["budget"] != alias:
        raise ValueError(f"--budget {given['budget']} and --max-kv-size {alias} are one setting; "
                         "give one of them")
    if given["budget"] is None:
        given["budget"] = alias
    return {f: v for f, v in given.items() if v is not None}


def load_filters(path: str | None, model: str | None, needed: bool, prog: str) -> QueryFilters | None:
    """The query filters the command's qfilter caches read, once, before the
    model loads: ``path`` (``--filters``), else the file ``mlx-knorm
    calibrate`` writes for ``model`` if there is one. An unreadable
    ``--filters`` file, or no filters where ``needed`` (``--scorer
    qfilter``), raises ``ValueError``; an unreadable default file is only
    reported unless needed (a server request may still name another scorer)."""
    given = path is not None
    if not given and model is not None and default_filters_path(model).is_file():
        path = str(default_filters_path(model))
    if path is None:
        if needed:
            raise ValueError("--scorer qfilter needs the model's query filters: run `mlx-knorm calibrate "
                             f"--model {model or 'M'}` (or give --filters FILE)")
        return None
    try:
        return QueryFilters.load(path)
    except (OSError, ValueError, RuntimeError) as e:
        if given or needed:
            raise ValueError(f"--filters {path}: {e}") from None
        print(f"{prog}: warning: ignoring the query filters at {path} ({e}); --scorer qfilter "
              "needs readable ones", file=sys.stderr)
        return None


def cache_config(settings: dict, base: CacheConfig | None = None) -> CacheConfig:
    """``base`` (the defaults) with ``settings`` over it; a bad value raises
    ``ValueError`` naming it (``TypeError``s become ``ValueError``s, which is
    what mlx-lm's server answers with HTTP 400)."""
    try:
        return replace(base or CacheConfig(), **settings)
    except (TypeError, ValueError) as e:
        raise ValueError(str(e)) from None


@contextlib.contextmanager
def patched(module: types.ModuleType, **attributes):
    """``module``'s globals replaced by ``attributes`` inside, restored after."""
    previous = {name: getattr(module, name) for name in attributes}
    try:
        for name, value in attributes.items():
            setattr(module, name, value)
        yield
    finally:
        for name, value in previous.items():
            setattr(module, name, value)


class Session:
    """One run of ``mlx-knorm NAME``: mlx-lm's ``module.main()`` with our flags and caches.

    ``cache_factory(model, config)`` replaces ``config.make_cache(model)``
    (the benchmark's baseline server uses it).
    """

    def __init__(self, name: str, module: types.ModuleType, description: str, *,
                 cache_factory: Callable | None = None) -> None:
        self.name, self.module, self.description = name, module, description
        self.prog = f"mlx-knorm {name}"
        self.cache_factory = cache_factory
        self.config = CacheConfig()
        self.given: dict = {}  # cache settings given on the command line
        self.given_filters: QueryFilters | None = None  # the filters --filters names, when given
        self.model_name: str | None = None  # --model
        self.kv_quantization: tuple = (None, None)  # mlx-lm's --kv-bits, --kv-group-size
        self.draft_path: str | None = None  # mlx-lm's --draft-model
        self._target_loaded = False  # the target of the models being loaded is in
        # The draft models loaded (their caches take no skip_layers), weakly:
        # models are dicts, so no WeakSet holds them.
        self._drafts: list[weakref.ref] = []
        self.last_cache: list | None = None  # the latest cache the factory built
        self._request = threading.local()

    # -- the parser ---------------------------------------------------------

    def argparse_module(self) -> types.SimpleNamespace:
        """``argparse`` with an ``ArgumentParser`` that adds and checks our flags."""
        session = self

        class ArgumentParser(argparse.ArgumentParser):
            def __init__(self, *args, **kwargs):
                kwargs["prog"] = session.prog
                kwargs["description"] = session.description
                kwargs["formatter_class"] = argparse.RawDescriptionHelpFormatter
                super().__init__(*args, **kwargs)
                self._mlx_knorm_flags = False

            def parse_known_args(self, args=None, namespace=None):
                if not self._mlx_knorm_flags:
                    self.description = f"{session.description}\n\n{session.flags_note()}"
                    add_cache_arguments(self)
                    self._mlx_knorm_flags = True
                namespace, rest = super().parse_known_args(args, namespace)
                session.resolve(self, namespace)
                return namespace, rest

        return types.SimpleNamespace(**{**vars(argparse), "ArgumentParser": ArgumentParser})

    def flags_note(self) -> str:
        """How mlx-lm's flags behave here, for the help's description."""
        return textwrap.fill(
            f"Every flag of {self.module.__name__} works as there, but for --max-kv-size, which is "
            "the same as --budget; --kv-bits quantizes the kept rows, and a --draft-model's cache "
            "evicts too (without --skip-layers). The cache's own flags are at the end.", width=80)

    def resolve(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace) -> None:
        self.kv_quantization = (getattr(namespace, "kv_bits", None), getattr(namespace, "kv_group_size", None))
        self.loading_models(getattr(namespace, "draft_model", None))
        try:
            self.given = given_cache_settings(namespace)
            # The qfilter scorer's filters (a server request may ask for it too).
            filters = load_filters(getattr(namespace, "filters", None), getattr(namespace, "model", None),
                                   self.given.get("scorer") == "qfilter", self.prog)
            self.config = cache_config({**self.given, "filters": filters})
            self.given_filters = filters if getattr(namespace, "filters", None) is not None else None
            self.model_name = getattr(namespace, "model", None)
            check_draft_tokens(getattr(namespace, "num_draft_tokens", None), "--num-draft-tokens")
        except ValueError as e:
            parser.error(str(e))
        if self.draft_path is not None and self.config.skip_layers:
            print(f"{self.prog}: warning: {SKIP_LAYERS_WITH_DRAFT}", file=sys.stderr)

    # -- caches ---------------------------------------------------------------

    def current_config(self) -> CacheConfig:
        """The settings for caches built now: a server request's own, else the command line's."""
        return getattr(self._request, "config", None) or self.config

    @contextlib.contextmanager
    def request_config(self, config: CacheConfig):
        """Caches built in this thread inside use ``config``."""
        self._request.config = config
        try:
            yield
        finally:
            self._request.config = None

    def loading_models(self, draft_path: str | None) -> None:
        """A target model is loaded next and then, if ``draft_path`` is
        given, its draft from there (mlx-lm's order, in ``generate`` and in
        the server's ``ModelProvider._load``; the two may share a path)."""
        self.draft_path, self._target_loaded = draft_path, False

    def add_draft(self, model) -> None:
        if not self.is_draft(model):
            self._drafts = [r for r in self._drafts if r() is not None] + [weakref.ref(model)]

    def is_draft(self, model) -> bool:
        return any(r() is model for r in self._drafts)

    def make_cache(self, model) -> list:
        config = self.current_config()
        draft = self.is_draft(model)
        if draft:
            config = config.for_draft()
        cache = self.cache_factory(model, config) if self.cache_factory else config.make_cache(model)
        if not draft:  # the memory line reports the target's cache
            self.last_cache = cache
        return cache

    def wrap_loader(self, loader: Callable) -> Callable:
        """``loader`` (``load_model``, or mlx-lm's ``sharded_load``), then our
        caches for the model it returns first."""

        def load(*args, **kwargs):
            loaded = loader(*args, **kwargs)
            model = loaded[0]
            draft = (self._target_loaded and self.draft_path is not None and bool(args)
                     and str(args[0]) == str(self.draft_path))
            if draft:
                self.add_draft(model)
            install_cache(model, self.make_cache)
            if draft:
                self.draft_loaded(model)
            else:
                self._target_loaded = True
                self.model_loaded(model)
            return loaded

        return load

    def model_loaded(self, model) -> None:
        """Called after each model load but a draft's (the generate command checks its prompt cache here)."""

    def draft_loaded(self, model) -> None:
        """Called after a draft model's load (the generate command gives it a cache next to a prompt cache's)."""

    # -- running --------------------------------------------------------------

    def run(self, argv: list[str], **patches) -> int:
        """mlx-lm's ``main()`` on ``argv`` with our parser, loader and ``patches``;
        returns the exit status."""
        module = self.module
        replaced = {"argparse": self.argparse_module(), "load": self.wrap_loader(load_model), **patches}
        if hasattr(module, "sharded_load"):
            replaced["sharded_load"] = self.wrap_loader(module.sharded_load)
        argv_before = sys.argv
        sys.argv = [self.prog, *argv]
        try:
            with patched(module, **replaced):
                module.main()
        except (CommandError, ValueError) as e:
            print(f"{self.prog}: error: {e}", file=sys.stderr)
            return 1
        finally:
            sys.argv = argv_before
        return 0

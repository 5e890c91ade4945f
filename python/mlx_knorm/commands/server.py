"""``mlx-knorm server``: ``mlx_lm.server``'s ``main`` with an eviction cache per request.

mlx-lm's server, its HTTP handling and its generation thread run as they
are; four of ``mlx_lm.server``'s globals are replaced by thin subclasses or
wrappers for the duration of ``main``:

- ``APIHandler``: after mlx-lm's own parameter checks, the request's cache
  fields (``budget``, ``max_kv_size``, ``n_sink``, ``recent``, ``keep``,
  ``skip_layers``, ``layout``; each defaults to the command line's) are
  checked the same way, so a bad one is answered as mlx-lm answers a bad
  ``max_tokens``: HTTP 400 with ``{"error": ...}``. The settings ride on the
  ``CompletionRequest`` to the generation thread. (Installed through
  ``_run_http_server``, since ``mlx_lm.server.run`` does not pass its
  ``handler_class`` on.)
- ``ResponseGenerator``: ``_serve_single`` builds the request's caches with
  its settings (model-dependent checks such as ``skip_layers`` against the
  layer count fail there, before the response starts, as mlx-lm reports a
  failed model load) and resets the peak memory for the request's report.
- ``LRUPromptCache``: ``mlx_knorm.lru.LRUPromptCache`` (mlx-lm's class,
  which asks a cache's ``trimmable()`` before it trims it to a shorter
  prompt or drops the entries it could stand in for), keyed by model *and*
  cache settings, so a request never continues a cache made with other
  settings. Each request's cache is inserted once it is done, and then its
  statistics are logged as ``mlx_lm.generate`` prints them (from the last
  ``GenerationResponse``, which a wrapped ``stream_generate`` keeps), with
  the KV memory line.
- ``scan_cache_dir``: ``/v1/models`` lists the served model even where no
  Hugging Face cache directory exists (mlx-lm's handler would fail there).

A cached conversation is reused for a prompt that continues it (a
follow-up turn: the conversation so far is the stored prompt plus its
answer), or for one that leaves it only within what its caches can trim
exactly (what no eviction has ranked yet). A draft model's cache evicts
too, without ``skip_layers``. ``L2NormKVCache`` has no ``merge``, so
mlx-lm's server finds the model not batchable and serves one request at a
time (``_serve_single``); once the cache can merge, mlx-lm batches it.
"""

from __future__ import annotations

import functools
import importlib
import logging
import types

import mlx.core as mx
from huggingface_hub.utils import CacheNotFound

from ..lru import LRUPromptCache as TrimAwareLRUPromptCache
from .memory import kv_memory_line
from .session import BUDGET_ALIAS, CACHE_FIELDS, Session, cache_config

mlx_lm_server = importlib.import_module("mlx_lm.server")

DESCRIPTION = """\
mlx_lm.server (OpenAI-compatible: /v1/chat/completions, /v1/completions,
streaming or not, /v1/models) with an L2-norm eviction cache per request: each
attention layer keeps at most --budget rows per head, so memory stays fixed
however long a conversation grows.

Requests are served one at a time: mlx-lm batches only caches that can merge,
and L2NormKVCache cannot yet, so --decode-concurrency and --prompt-concurrency
do not apply. Other clients wait in mlx-lm's queue.

A request may set its own cache with the fields "budget" (or "max_kv_size"),
"n_sink", "recent", "keep", "skip_layers" and "layout"; the flags below are the
defaults. A bad value gets HTTP 400, as a bad max_tokens does."""


def request_settings(body: dict) -> dict:
    """The cache fields of a request body, ``max_kv_size`` as ``budget``;
    raises ``ValueError`` (HTTP 400) on a conflict or a bad type."""
    given = {f: body[f] for f in CACHE_FIELDS if f in body}
    if BUDGET_ALIAS in body:
        if "budget" in given and given["budget"] != body[BUDGET_ALIAS]:
            raise ValueError(f"budget ({given['budget']}) and max_kv_size ({body[BUDGET_ALIAS]}) "
                             "are one setting; give one of them")
        given["budget"] = body[BUDGET_ALIAS]
    if "skip_layers" in given and not isinstance(given["skip_layers"], list):
        raise ValueError("skip_layers must be a list of layer indices")
    return given


class ServerSession(Session):
    def __init__(self, cache_factory=None) -> None:
        super().__init__("server", mlx_lm_server, DESCRIPTION, cache_factory=cache_factory)
        self.last_response = None  # of the request being served (one at a time)

    def patches(self) -> dict:
        session = self

        class APIHandler(mlx_lm_server.APIHandler):
            def validate_model_parameters(self) -> None:
                super().validate_model_parameters()
                self.mlx_knorm_cache = cache_config(request_settings(self.body), session.config)

            def handle_chat_completions(self):
                request = super().handle_chat_completions()
                request.mlx_knorm_cache = self.mlx_knorm_cache
                return request

            def handle_text_completions(self):
                request = super().handle_text_completions()
                request.mlx_knorm_cache = self.mlx_knorm_cache
                return request

        class ResponseGenerator(mlx_lm_server.ResponseGenerator):
            def __init__(self, *args, **kwargs):
                logging.info(f"mlx-knorm: L2-norm eviction caches ({session.config.describe()}); "
                             "requests are served one at a time (the cache cannot be batched yet)")
                super().__init__(*args, **kwargs)

            def _serve_single(self, request, stream):
                rqueue, completion, _ = request
                config = getattr(completion, "mlx_knorm_cache", None) or session.config
                with session.request_config(config):
                    try:
                        self.model_provider.model.make_cache()
                    except (TypeError, ValueError) as e:
                        rqueue.put(e)
                        return
                    mx.reset_peak_memory()
                    super()._serve_single(request, stream)

        class ModelProvider(mlx_lm_server.ModelProvider):
            def _load(self, model_path, adapter_path=None, draft_model_path=None):
                session.loading_models(draft_model_path)
                super()._load(model_path, adapter_path, draft_model_path)

        class LRUPromptCache(TrimAwareLRUPromptCache):
            def fetch_nearest_cache(self, model, tokens):
                return super().fetch_nearest_cache((model, session.current_config()), tokens)

            def insert_cache(self, model, tokens, prompt_cache, *, cache_type="assistant"):
                # The target's layers (a draft model's follow them).
                target = prompt_cache[: len(session.last_cache or prompt_cache)]
                logging.info(f"{session.statistics()}; {kv_memory_line(target)}")
                super().insert_cache((model, session.current_config()), tokens, prompt_cache,
                                     cache_type=cache_type)

        generate = mlx_lm_server.stream_generate

        def stream_generate(*args, **kwargs):
            session.last_response = None
            for response in generate(*args, **kwargs):
                session.last_response = response
                yield response

        scan = mlx_lm_server.scan_cache_dir

        def scan_cache_dir(*args, **kwargs):
            try:
                return scan(*args, **kwargs)
            except CacheNotFound:
                return types.SimpleNamespace(repos=frozenset())

        return {
            "_run_http_server": functools.partial(mlx_lm_server._run_http_server, handler_class=APIHandler),
            "ResponseGenerator": ResponseGenerator,
            "ModelProvider": ModelProvider,
            "LRUPromptCache": LRUPromptCache,
            "scan_cache_dir": scan_cache_dir,
            "stream_generate": stream_generate,
        }

    def statistics(self) -> str:
        """The finished request's statistics, as ``mlx_lm.generate`` prints them."""
        r = self.last_response
        peak = f"Peak memory: {mx.get_peak_memory() / 1e9:.3f} GB"
        if r is None:
            return peak
        return (f"Prompt: {r.prompt_tokens} tokens, {r.prompt_tps:.3f} tokens-per-sec; "
                f"Generation: {r.generation_tokens} tokens, {r.generation_tps:.3f} tokens-per-sec; {peak}")


def main(argv: list[str], cache_factory=None) -> int:
    """``cache_factory(model, config)``, when given, builds each request's cache
    instead of ``make_knorm_cache`` (the benchmark's baseline)."""
    session = ServerSession(cache_factory)
    return session.run(argv, **session.patches())

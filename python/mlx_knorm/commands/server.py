"""``mlx-knorm server``: ``mlx_lm.server``'s ``main`` with an eviction cache per request.

mlx-lm's server, its HTTP handling and its generation thread run as they
are; some of ``mlx_lm.server``'s globals are replaced by thin subclasses or
wrappers for the duration of ``main``:

- ``APIHandler``: after mlx-lm's own parameter checks, the request's cache
  fields (``session.CACHE_FIELDS`` and ``max_kv_size``; each defaults to
  the command line's) are
  checked the same way, so a bad one is answered as mlx-lm answers a bad
  ``max_tokens``: HTTP 400 with ``{"error": ...}``; so are what mlx-lm
  passes on unchecked and its generation thread (or process) dies of (an
  empty or non-string ``prompt``, a ``stop`` of other types, a negative
  ``logit_bias`` token) and more draft tokens than a verify block holds
  exactly (``check_draft_tokens``). The settings ride on the
  ``CompletionRequest`` to the generation thread. A client that closes its
  connection ends the answer (``until_client_gone``; a stream's failed
  write ends it too), and mlx-lm's handler then stops the request.
  (Installed through ``_run_http_server``, since ``mlx_lm.server.run``
  does not pass its ``handler_class`` on.)
- ``ResponseGenerator``: ``generate`` watches the client's connection while
  the answer runs; ``_tokenize`` refuses, for that request alone, what the
  text does not show (no tokens, a ``logit_bias`` token past the
  vocabulary) before it reaches the batch; ``_serve_single`` builds the
  request's caches with its settings (model-dependent checks such as
  ``skip_layers`` against the layer count fail there, before the response
  starts, as mlx-lm reports a failed model load) and resets the peak
  memory for the request's report.
- ``TimeBudget``: mlx-lm's round of batch steps, cut short after a client
  leaves, so that the loop removes its request within a step or two.
- ``LRUPromptCache``: prefix reuse keyed by model *and* cache settings, so a
  request never continues a cache made with other settings, on
  ``mlx_knorm.lru.LRUPromptCache`` (which trims a stored cache only by what
  its ``trimmable()`` allows). Each request's
  cache is inserted once it is done, and then its statistics are logged as
  ``mlx_lm.generate`` prints them (from the last ``GenerationResponse``,
  which a wrapped ``stream_generate`` keeps), with the KV memory line, and
  what the store then holds (``mlx-knorm: prompt cache: N sequences, B
  bytes``). A batched request's checkpoint of its prompt without the last
  token is dropped once the request's own cache is stored (below).
- ``scan_cache_dir``: ``/v1/models`` lists the served model even where no
  Hugging Face cache directory exists (mlx-lm's handler would fail there).

- ``BatchGenerator``: mlx-lm's, timing each request it serves so that a
  batched request's statistics are logged as a single one's are, a
  request stopped early included (the peak memory is reset when a request
  joins an idle batch, as ``_serve_single`` resets it per request).

mlx-lm's batch loop splits a prompt's last token off into a segment of its
own (``BatchGenerator.insert_segments``), and the server stores a cache at
the end of every segment but the last that has a type left: so each
batched request also stores its cache after all of its prompt but the last
token, next to the cache it stores when it is done (prompt and answer).
mlx-lm's store drops that checkpoint for a cache that can trim back to it
(a ``KVCache``); a cache that has evicted past it (ours, or a wrapped
``RotatingKVCache``) cannot, so every conversation would be held twice
(a ``RotatingKVCache``'s checkpoint, taken mid-prefill, even holds the
whole last prefill block). Here a request's own end-of-prompt checkpoint is
dropped once its finished cache is stored, so the store holds one cache a
conversation, as when it is served alone; a follow-up continues the
finished cache. The checkpoints of earlier segments (a chat's system
prompt, its user turn before a thinking tail) stay, as in mlx-lm, and a
request that ends without its cache stored (a client that disconnects)
keeps its checkpoint.

A cached conversation is reused for a prompt that continues it (a
follow-up turn: the conversation so far is the stored prompt plus its
answer, as far as its caches hold it: speculative decoding's last token
may not be in them), or for one that leaves it only within what its caches can trim
exactly (what no eviction has ranked yet). A draft model's cache evicts
too, without ``skip_layers``; mlx-lm never batches requests with a draft
model or ``--kv-bits``.

Concurrent requests are batched by mlx-lm's own loop (``BatchGenerator``,
``L2NormKVCache.merge``) when their caches can be: every layer an
``L2NormKVCache`` (no ``skip_layers``: the model shares the first layer's
mask), and one batch holds requests of equal cache settings only.
``_is_batchable`` answers per request; a request with other settings waits
for the batch to finish and then starts the next one, and one that cannot
be batched is served alone (``_serve_single``).
"""

from __future__ import annotations

import collections
import functools
import importlib
import textwrap
import io
import json
import logging
import select
import socket
import threading
import time
import types
import weakref

import mlx.core as mx
from huggingface_hub.utils import CacheNotFound

from ..cache import L2NormCacheBase, L2NormKVCache, layer_caches
from ..lru import LRUPromptCache as TrimAwareLRUPromptCache
from ..lru import tokens_held
from ..validation import INT32_MAX
from .memory import kv_memory_line
from .session import BUDGET_ALIAS, CACHE_FIELDS, Session, cache_config, check_draft_tokens

mlx_lm_server = importlib.import_module("mlx_lm.server")

DESCRIPTION = """\
mlx_lm.server (OpenAI-compatible: /v1/chat/completions, /v1/completions,
streaming or not, /v1/models) with an L2-norm eviction cache per request: each
attention layer keeps at most --budget rows per head, so memory stays fixed
however long a conversation grows.

Concurrent requests with the same cache settings are batched, each sequence
keeping what it would keep alone (--decode-concurrency and --prompt-concurrency
as in mlx_lm.server); requests with other settings wait for the batch, and
caches with --skip-layers are served one at a time.

""" + textwrap.fill(
    "A request may set its own cache with the fields "
    + ", ".join(f'"{f}"' + (f' (or "{BUDGET_ALIAS}")' if f == "budget" else "") for f in CACHE_FIELDS)
    + ' ("scorer": knorm, keydiff, vnorm, or qfilter where the server has the model\'s filters: --filters, '
    "or calibrate's file for --model); the flags below are the defaults. A bad value gets HTTP 400, as a bad "
    "max_tokens does.", width=79)


class ClientGone(ConnectionError):
    """The client of a request closed its connection before the answer ended."""


CLIENT_GONE = "the client closed its connection; its request is stopped"
# The cache settings whose batchability the server remembers (the latest asked about).
BATCHABLE_MEMO_SIZE = 64
# Rounds of batch steps that end at their first step once a request is
# stopped (TimeBudget): mlx-lm's loop removes a stopped request only at the
# end of a round, and the step that shows it stopped may fall in the
# round after the one running when it stopped.
CUT_ROUNDS = 2


def check_request_body(path: str, body: dict, logit_bias) -> None:
    """What mlx-lm's handler passes on unchecked and its generation thread
    cannot take (an empty or non-string prompt ends it; an out-of-range
    logit bias token ends the process): ``ValueError``, which the handler
    answers with HTTP 400. ``logit_bias`` as mlx-lm's check leaves it."""
    if path == "/v1/completions" and "prompt" in body:
        prompt = body["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"prompt must be a non-empty string, got {json.dumps(prompt)[:40]}")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(word, str) for word in stop)):
        raise ValueError("stop must be a string or a list of strings")
    for token in logit_bias or ():
        if not 0 <= token <= INT32_MAX:
            raise ValueError(f"logit_bias token ids must be in [0, 2**31), got {token}")


def check_prompt_tokens(prompt: list, args, model, tokenizer) -> None:
    """A tokenized request the generation thread can serve (what the text
    does not show: a chat template or tokenizer giving no tokens, a logit
    bias past the model's vocabulary); ``ValueError`` otherwise, which
    mlx-lm's thread reports to that request alone."""
    if not prompt:
        raise ValueError("the prompt holds no tokens; generation needs at least one")
    bias = args.logits.logit_bias
    if bias:
        sizes = (getattr(getattr(model, "args", None), "vocab_size", None), len(tokenizer))
        vocabulary = min(n for n in sizes if isinstance(n, int))
        outside = sorted(t for t in bias if t >= vocabulary)
        if outside:
            raise ValueError(f"logit_bias token {outside[0]} is outside the model's {vocabulary} tokens")


def client_gone(connection) -> bool:
    """Whether the client closed ``connection`` (a socket whose request has
    been read): readable with nothing to read, or reset. (``poll``, not
    ``select``, which refuses descriptors past 1023.)"""
    try:
        poller = select.poll()
        poller.register(connection, select.POLLIN)
        return bool(poller.poll(0)) and connection.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


def until_client_gone(responses, connection):
    """``responses`` while the client is there; ``ClientGone`` once it is
    not, which ends mlx-lm's handler and with it the generation (its
    ``finally`` stops the request's context)."""
    for response in responses:
        if client_gone(connection):
            raise ClientGone(CLIENT_GONE)
        yield response


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
    if "scorer" in given and not isinstance(given["scorer"], str):
        raise ValueError("scorer must be a string")
    return given


def check_qfilter_request(config, requested_model: str, served_model: str | None) -> None:
    """A request asking for ``scorer: qfilter`` needs the server's query
    filters, which are those of its ``--model`` (``--filters``, or
    ``calibrate``'s file for it): ``ValueError`` (HTTP 400) without them, or
    for a request naming another model, whose queries they do not measure."""
    if config.filters is None:
        raise ValueError("scorer qfilter needs the model's query filters, which this server has "
                         "none of: run `mlx-knorm calibrate --model M`, or start it with --filters FILE")
    if requested_model not in ("default_model", served_model):
        raise ValueError(f"scorer qfilter: this server's query filters are its --model {served_model}'s, "
                         f"not model {requested_model}'s; ask that model for another scorer, or serve it "
                         "with its own filters")


class ServerSession(Session):
    def __init__(self, cache_factory=None) -> None:
        super().__init__("server", mlx_lm_server, DESCRIPTION, cache_factory=cache_factory)
        self.last_response = None  # of the request being served alone
        self.batch_config = None  # the cache settings of the batch being served
        self.batch_statistics: dict[int, str] = {}  # id(finished prompt cache) -> its statistics
        # id(finished prompt cache) -> its prompt but the last token: the key
        # of the checkpoint mlx-lm's batch loop stored for the request.
        self.batch_checkpoints: dict[int, list] = {}
        # config -> whether it batches, for the model below; the latest
        # BATCHABLE_MEMO_SIZE settings asked about, so that requests that each
        # set other values do not grow it.
        self._batchable: collections.OrderedDict = collections.OrderedDict()
        self._batchable_model = lambda: None
        # The connection of the request an HTTP handler thread is answering.
        self._client = threading.local()
        self.rounds_to_cut = 0  # TimeBudget's, set when a request's client is gone

    def batchable(self, config, model) -> bool:
        """Whether requests with ``config`` can be batched: every layer of
        their cache an ``L2NormKVCache`` (or, for a baseline cache factory,
        none an eviction cache). A cache that fails to build is served
        alone, which reports the error."""
        if self._batchable_model() is not model:
            # Another model is served: its answers differ.
            self._batchable.clear()
            self._batchable_model = weakref.ref(model)
        key = config
        if key in self._batchable:
            self._batchable.move_to_end(key)
            return self._batchable[key]
        try:
            with self.request_config(config):
                cache = model.make_cache()
        except Exception:  # the request's own error, reported when it is served alone
            return False
        ours = [isinstance(c, L2NormCacheBase) for c in layer_caches(cache)]
        self._batchable[key] = (all(type(c) is L2NormKVCache for c in cache) if any(ours)
                                else all(hasattr(c, "merge") for c in cache))
        while len(self._batchable) > BATCHABLE_MEMO_SIZE:
            self._batchable.popitem(last=False)
        return self._batchable[key]

    def patches(self) -> dict:
        session = self

        class APIHandler(mlx_lm_server.APIHandler):
            def do_POST(self):
                # mlx-lm decodes the body unguarded: one that is not UTF-8
                # would end the handler with no answer. Read and checked
                # here, it is handed to mlx-lm's do_POST as it came.
                try:
                    length = int(self.headers.get("Content-Length"))
                except (TypeError, ValueError):
                    return super().do_POST()  # mlx-lm answers 411 or 400
                why = None
                if length < 0:  # mlx-lm would read to the end of a stream that does not end
                    why = "Invalid Content-Length header"
                else:
                    raw = self.rfile.read(length)
                    try:
                        raw.decode("utf-8")
                    except UnicodeDecodeError as e:
                        why = f"the request body is not UTF-8 ({e})"
                if why is not None:
                    self._set_completion_headers(400)
                    self.end_headers()
                    self.wfile.write(json.dumps({"error": why}).encode())
                    return
                rfile, self.rfile = self.rfile, io.BytesIO(raw)
                try:
                    super().do_POST()
                finally:
                    self.rfile = rfile

            def validate_model_parameters(self) -> None:
                super().validate_model_parameters()
                check_request_body(self.path, self.body, self.logit_bias)
                check_draft_tokens(self.num_draft_tokens)
                self.mlx_knorm_cache = cache_config(request_settings(self.body), session.config)
                if self.mlx_knorm_cache.scorer == "qfilter":
                    check_qfilter_request(self.mlx_knorm_cache, self.requested_model, session.model_name)

            def handle_completion(self, request, stop_words):
                # ResponseGenerator.generate watches this connection.
                session._client.connection = self.connection
                try:
                    super().handle_completion(request, stop_words)
                except ConnectionError as gone:
                    # Found by the watch, or by a write (a stream): mlx-lm's
                    # handler has stopped the request's context.
                    self.close_connection = True
                    session.rounds_to_cut = CUT_ROUNDS
                    logging.info(f"mlx-knorm: {gone if isinstance(gone, ClientGone) else CLIENT_GONE}")
                finally:
                    session._client.connection = None

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
                             "concurrent requests with the same cache settings are batched")
                super().__init__(*args, **kwargs)

            def generate(self, request, generation_args, progress_callback=None):
                # _is_batchable sees only the arguments: they carry the settings too.
                generation_args.mlx_knorm_cache = getattr(request, "mlx_knorm_cache", None)
                connection = getattr(session._client, "connection", None)
                if connection is None:
                    return super().generate(request, generation_args, progress_callback)

                def progress(*counts):
                    # A long prompt reports progress before any token.
                    if client_gone(connection):
                        raise ClientGone(CLIENT_GONE)
                    if progress_callback is not None:
                        progress_callback(*counts)

                ctx, responses = super().generate(request, generation_args, progress)
                return ctx, until_client_gone(responses, connection)

            def _tokenize(self, tokenizer, request, args):
                tokenized = super()._tokenize(tokenizer, request, args)
                check_prompt_tokens(tokenized[0], args, self.model_provider.model, tokenizer)
                return tokenized

            def _is_batchable(self, args):
                config = getattr(args, "mlx_knorm_cache", None) or session.config
                model = self.model_provider.model
                if not super()._is_batchable(args) or model is None or not session.batchable(config, model):
                    return False
                if session.batch_config is None:
                    session.batch_config = config
                if config != session.batch_config:
                    return False
                # The caches the batch builds, and the prompt cache's keys, take
                # the batch's settings (this is the generation thread).
                session._request.config = config
                session.last_response = None
                return True

            def _serve_single(self, request, stream):
                rqueue, completion, _ = request
                config = getattr(completion, "mlx_knorm_cache", None) or session.config
                with session.request_config(config):
                    try:
                        self.model_provider.model.make_cache()
                    except Exception as e:  # a cache this request's settings cannot build: its answer
                        rqueue.put(e)
                        return
                    mx.reset_peak_memory()
                    super()._serve_single(request, stream)

        class ModelProvider(mlx_lm_server.ModelProvider):
            def _load(self, model_path, adapter_path=None, draft_model_path=None):
                session.loading_models(draft_model_path)
                super()._load(model_path, adapter_path, draft_model_path)

            def load_default(self):
                # mlx-lm loads the default model as the generation thread
                # starts, where a raise ends the thread. A model family the
                # cache refuses (make_knorm_cache's ValueError) is instead
                # loaded again by each request, which gets the refusal.
                try:
                    super().load_default()
                except ValueError as e:
                    logging.error(str(e))

        class LRUPromptCache(TrimAwareLRUPromptCache):
            def fetch_nearest_cache(self, model, tokens):
                return super().fetch_nearest_cache((model, session.current_config()), tokens)

            def insert_cache(self, model, tokens, prompt_cache, *, cache_type="assistant"):
                key = (model, session.current_config())
                # A finished request's cache (a batch also stores the caches
                # of its prompts' segments, which are not logged); the
                # target's layers (a draft model's follow them; drafts are
                # never batched).
                finished = id(prompt_cache) in session.batch_statistics or session.batch_config is None
                checkpoint = session.batch_checkpoints.pop(id(prompt_cache), None)
                if finished:
                    target = prompt_cache[: len(session.last_cache or prompt_cache)]
                    logging.info(f"{session.statistics(prompt_cache)}; {kv_memory_line(target)}")
                super().insert_cache(key, tokens, prompt_cache, cache_type=cache_type)
                if not finished:
                    # A segment's checkpoint (under the tokens it holds, as stored).
                    entry = self.entry(key, tokens[: tokens_held(prompt_cache, len(tokens))])
                    if entry is not None and entry.prompt_cache is prompt_cache:
                        entry.mlx_knorm_checkpoint = True
                    return
                if checkpoint is not None:
                    # The request's end-of-prompt checkpoint, where it is still
                    # the one stored there (module docstring).
                    entry = self.entry(key, checkpoint)
                    if entry is not None and getattr(entry, "mlx_knorm_checkpoint", False):
                        self.remove(key, checkpoint)
                logging.info(f"mlx-knorm: prompt cache: {len(self)} sequences, {self.nbytes} bytes")

        generate = mlx_lm_server.stream_generate

        def stream_generate(*args, **kwargs):
            session.last_response = None
            for response in generate(*args, **kwargs):
                session.last_response = response
                yield response

        class BatchGenerator(mlx_lm_server.BatchGenerator):
            """mlx-lm's, timing each request from its insertion: prompt
            tokens/s to its first token, generation tokens/s after it."""

            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                session.batch_config = None
                # uid -> [prompt tokens, inserted, first token, tokens, the
                # prompt but its last token (its checkpoint's key)]
                self._mlx_knorm_timing = {}

            def insert_segments(self, segments, *args, **kwargs):
                # The tokens each sequence's cache holds already (insert_segments'
                # fourth parameter), then its segments: its whole prompt.
                cached = kwargs.get("all_tokens", args[2] if len(args) > 2 else None) or [[]] * len(segments)
                prompts = [[*c, *(t for s in seq for t in s)] for c, seq in zip(cached, segments)]
                if not self._mlx_knorm_timing:
                    mx.reset_peak_memory()  # the peak of a lone request is its own
                uids = super().insert_segments(segments, *args, **kwargs)
                now = time.perf_counter()
                for uid, seq, prompt in zip(uids, segments, prompts):
                    self._mlx_knorm_timing[uid] = [sum(len(s) for s in seq), now, None, 0, prompt[:-1]]
                logging.info(f"mlx-knorm: batching {len(self._mlx_knorm_timing)} requests "
                             f"({session.current_config().describe()})")
                return uids

            def next(self):
                prompt_responses, generation_responses = super().next()
                now = time.perf_counter()
                for r in generation_responses:
                    timing = self._mlx_knorm_timing.get(r.uid)
                    if timing is None:
                        continue
                    if timing[2] is None:
                        timing[2] = now
                    timing[3] += 1
                    if r.finish_reason is not None:
                        timing = self._mlx_knorm_timing.pop(r.uid)
                        session.batch_statistics[id(r.prompt_cache)] = self._statistics(timing, now)
                        session.batch_checkpoints[id(r.prompt_cache)] = timing[4]
                return prompt_responses, generation_responses

            @staticmethod
            def _statistics(timing: list, now: float) -> str:
                prompt_tokens, inserted, first, tokens, _ = timing
                first = now if first is None else first
                return session.statistics_line(prompt_tokens, prompt_tokens / max(first - inserted, 1e-9),
                                               tokens, (tokens - 1) / (now - first) if tokens > 1 else 0.0)

            def remove(self, uids, *args, **kwargs):
                # mlx-lm's loop removes a request whose answer ended first (its client is gone).
                now = time.perf_counter()
                for uid in uids:
                    timing = self._mlx_knorm_timing.pop(uid, None)
                    if timing is not None:
                        logging.info(f"mlx-knorm: stopped a request (its client is gone): "
                                     f"{self._statistics(timing, now)}")
                return super().remove(uids, *args, **kwargs)

            def close(self):
                session.batch_config = None
                super().close()

        class TimeBudget(mlx_lm_server.TimeBudget):
            """mlx-lm's round of batch steps (half a second), ending at its
            first step while ``rounds_to_cut`` says so: a request whose
            client is gone is then removed within a step or two, not after
            the round. Not between processes: every rank counts the same
            steps."""

            def __iter__(self):
                self._mlx_knorm_steps = 0
                return super().__iter__()

            def __next__(self):
                if not self._is_distributed and session.rounds_to_cut > 0 and self._mlx_knorm_steps:
                    session.rounds_to_cut -= 1
                    raise StopIteration()
                self._mlx_knorm_steps += 1
                return super().__next__()

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
            "BatchGenerator": BatchGenerator,
            "TimeBudget": TimeBudget,
        }

    def statistics(self, prompt_cache=None) -> str:
        """The finished request's statistics, as ``mlx_lm.generate`` prints
        them: a batched request's (by its prompt cache), else the latest
        request served alone."""
        batched = self.batch_statistics.pop(id(prompt_cache), None)
        if batched is not None:
            return batched
        r = self.last_response
        if r is None:
            return self.peak_memory()
        return self.statistics_line(r.prompt_tokens, r.prompt_tps, r.generation_tokens, r.generation_tps)

    def statistics_line(self, prompt_tokens, prompt_tps, generation_tokens, generation_tps) -> str:
        return (f"Prompt: {prompt_tokens} tokens, {prompt_tps:.3f} tokens-per-sec; "
                f"Generation: {generation_tokens} tokens, {generation_tps:.3f} tokens-per-sec; "
                f"{self.peak_memory()}")

    @staticmethod
    def peak_memory() -> str:
        return f"Peak memory: {mx.get_peak_memory() / 1e9:.3f} GB"


def main(argv: list[str], cache_factory=None) -> int:
    """``cache_factory(model, config)``, when given, builds each request's cache
    instead of ``make_knorm_cache`` (the benchmark's baseline)."""
    session = ServerSession(cache_factory)
    return session.run(argv, **session.patches())

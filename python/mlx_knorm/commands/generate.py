"""``mlx-knorm generate``: ``mlx_lm.generate``'s ``main`` with eviction caches.

Besides the session's parser and loader, two of ``mlx_lm.generate``'s globals
are replaced: ``load_prompt_cache`` (a ``--prompt-cache-file`` is checked
before anything runs: ``prompt_cache.py``; with ``--draft-model`` the draft's
fresh cache is appended to it, where mlx-lm looks for it) and ``generate``
(the same call, then the target's KV memory line under mlx-lm's statistics
when ``--verbose``).
"""

from __future__ import annotations

import importlib

from .memory import kv_memory_line
from .prompt_cache import check_fits_model, load_checked
from .session import Session

# The module (``mlx_lm.generate`` as an attribute is mlx-lm's generate function).
mlx_lm_generate = importlib.import_module("mlx_lm.generate")

DESCRIPTION = """\
mlx_lm.generate with L2-norm KV-cache eviction: every attention layer keeps at
most --budget rows per head, so memory stays fixed however long the prompt and
the generation grow. With --verbose (the default) a line after mlx-lm's
statistics gives the KV bytes the caches hold and have allocated against what a
full cache would hold at that context."""


class GenerateSession(Session):
    def __init__(self, cache_factory=None) -> None:
        super().__init__("generate", mlx_lm_generate, DESCRIPTION, cache_factory=cache_factory)
        # mlx-lm's own, taken before run() replaces them in the module.
        self.mlx_lm_load_prompt_cache = mlx_lm_generate.load_prompt_cache
        self.mlx_lm_generate = mlx_lm_generate.generate
        self.prompt_cache_file = None
        self.loaded_prompt_cache = None

    def load_prompt_cache(self, file_name, return_metadata=False):
        cache, metadata = load_checked(self.mlx_lm_load_prompt_cache, file_name, self.kv_quantization)
        self.prompt_cache_file, self.loaded_prompt_cache = file_name, cache
        return (cache, metadata) if return_metadata else cache

    def model_loaded(self, model) -> None:
        if self.loaded_prompt_cache is not None:
            check_fits_model(self.prompt_cache_file, self.loaded_prompt_cache, model,
                             model.make_cache(), self.given, self.given_filters)

    def draft_loaded(self, model) -> None:
        # mlx-lm's speculative decoding takes the draft's layers from the
        # prompt cache, after the target's; a file holds the target's only
        # (mlx-lm itself then fails on an empty draft cache). The draft
        # starts afresh on the new prompt: its guesses lack the cached
        # context, the output (the target's tokens) does not.
        if self.loaded_prompt_cache is not None:
            self.loaded_prompt_cache.extend(model.make_cache())

    def generate(self, model, tokenizer, prompt, verbose=False, **kwargs):
        text = self.mlx_lm_generate(model, tokenizer, prompt, verbose=verbose, **kwargs)
        if verbose:
            cache = kwargs.get("prompt_cache") or self.last_cache
            print(kv_memory_line(cache[: len(model.layers)]))  # the target's layers
        return text


def main(argv: list[str], cache_factory=None) -> int:
    """``cache_factory(model, config)``, when given, builds the cache instead of
    ``make_knorm_cache`` (the benchmark's baseline)."""
    session = GenerateSession(cache_factory)
    return session.run(argv, load_prompt_cache=session.load_prompt_cache, generate=session.generate)

"""mlx-lm's ``LRUPromptCache`` for caches that trim only their newest tokens.

mlx-lm's prompt cache store (``mlx_lm.models.cache.LRUPromptCache``, which
``mlx_lm.server`` keeps its conversations in) treats a cache as trimmable
by any count once ``is_trimmable()`` says so: ``fetch_nearest_cache`` trims
a copy of a longer cached prompt down to the common prefix and ignores the
count ``trim_prompt_cache`` returns, and ``insert_cache`` drops the entries
of the new prompt's prefixes, counting on trimming the new cache back to
them. An ``L2NormKVCache`` trims exactly only what no eviction has ranked
yet (``trimmable()``, docs/spec.md §8), no further, so with mlx-lm's
class a request could be answered from a cache still holding tokens that
are not in its prompt.

``LRUPromptCache`` here is mlx-lm's class with four changes, and nothing else:

- ``insert_cache`` stores a cache under the tokens it holds: a key longer
  than the cache's ``offset`` (its first layer's) is cut to it. mlx-lm's
  server keys a finished request's caches by its prompt and every token it
  answered, but speculative decoding (``speculative_generate_step``) leaves
  the answer's last token out of the caches when that token is the
  target's own (not an accepted draft token): a follow-up keyed by the
  whole answer would continue a cache missing that token. Cut, the
  follow-up feeds it again, as the first of its prompt's tokens;
- ``fetch_nearest_cache`` takes the longer cached prompt only when every
  layer can trim it to the prefix (``can_trim_prompt_cache``); otherwise it
  answers as mlx-lm does for a cache that cannot trim: from the longest
  cached prefix, or with no cache;
- ``insert_cache`` drops a prefix's entry only when the new cache can be
  trimmed back to that prefix;
- an exact hit returns the cache trimmed by one token and the prompt's last
  token (when every layer can trim it; else the cache stored under the
  prompt without its last token, or failing that the nearest cache for
  those tokens, and that last token): mlx-lm returns no tokens to process,
  and generation refuses an empty prompt.

Layers without ``trimmable()`` (mlx-lm's own caches) answer by
``is_trimmable()``, as in mlx-lm, so for them the class behaves as mlx-lm's
but for exact hits. Two look-ups are added: ``entry`` (the entry stored
under exactly some tokens) and ``remove`` (drop it, its bytes with it), for
the server, which drops the checkpoints that mlx-lm's batch loop leaves
(``mlx_knorm.commands.server``).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from mlx_lm.models import cache as mlx_lm_cache


def can_trim_prompt_cache(prompt_cache: list, n: int) -> bool:
    """Whether ``trim_prompt_cache(prompt_cache, n)`` removes the ``n``
    newest tokens from every layer: a layer with ``trimmable()`` when
    ``n`` is no more than it, any other when ``is_trimmable()``."""
    return all(
        n <= layer.trimmable() if hasattr(layer, "trimmable") else layer.is_trimmable()
        for layer in prompt_cache
    )


def tokens_held(prompt_cache: list, default: int) -> int:
    """The tokens ``prompt_cache`` holds: its first layer's ``offset`` (a
    target's first, where a draft's layers follow), ``default`` when that
    layer counts none (a recurrent layer's cache) or holds more."""
    offset = getattr(prompt_cache[0], "offset", None) if prompt_cache else None
    return offset if isinstance(offset, int) and 0 <= offset < default else default


class _PromptTrie(mlx_lm_cache.PromptTrie):
    """mlx-lm's trie, whose ``pop_prefixes`` pops only the prefixes that
    ``replaceable(prefix_length)`` allows while one is set, and whose
    ``pop`` drops a model key once it holds nothing (mlx-lm's keeps an empty
    node for every key ever stored: the server's keys carry each request's
    cache settings, so settings that vary would grow it for good)."""

    replaceable: Callable[[int], bool] | None = None

    def pop(self, model: Any, tokens: list[int]):
        value = super().pop(model, tokens)
        if not self._trie[model]:
            del self._trie[model]
        return value

    def pop_prefixes(self, model: Any, tokens: list[int]):
        if self.replaceable is None:
            return super().pop_prefixes(model, tokens)
        values = []
        current = self._trie[model]
        for i, tok in enumerate(tokens):
            if "__value__" in current and self.replaceable(i):
                values.append((i, current.pop("__value__")))
            current = current[tok]
        return values


class LRUPromptCache(mlx_lm_cache.LRUPromptCache):
    """``mlx_lm.models.cache.LRUPromptCache`` that never asks a cache for a
    trim it cannot do (module docstring)."""

    def __init__(self, max_size: int = 10, max_bytes: int = 1 << 63):
        super().__init__(max_size=max_size, max_bytes=max_bytes)
        self._trie = _PromptTrie()

    def fetch_nearest_cache(self, model: Any, tokens: list[int]):
        return self._fetch_nearest(model, tokens)

    def _fetch_nearest(self, model: Any, tokens: list[int]):
        """The look-up under ``model`` as stored. A subclass that maps the
        key it is given (the server adds the cache settings) overrides
        ``fetch_nearest_cache`` alone, so the key is mapped once, the
        exact hit's fallback included."""
        result = self._trie.search(model, tokens)
        shorter = len(result.shorter) if result.shorter is not None else 0
        if result.exact is not None and tokens:
            # An exact hit leaves the prompt's last token to process (mlx-lm
            # returns no tokens at all, and generation refuses an empty prompt).
            entry = self._trie.get(result.model, result.exact)
            if can_trim_prompt_cache(entry.prompt_cache, 1):
                cache = copy.deepcopy(entry.prompt_cache)
                mlx_lm_cache.trim_prompt_cache(cache, 1)
                return cache, tokens[-1:]
            # The prompt without its last token: the cache stored under
            # exactly those tokens, as it is (the last token is left to
            # process), else the nearest cache for them.
            head = self.entry(model, tokens[:-1])
            if head is not None:
                return copy.deepcopy(head.prompt_cache), tokens[-1:]
            cache, rest = self._fetch_nearest(model, tokens[:-1])
            return cache, rest + tokens[-1:]
        if result.exact is None and result.longer is not None and result.common_prefix > shorter:
            # mlx-lm would trim the longer prompt's cache to this prefix.
            entry = self._trie.get(result.model, result.longer)
            prefix = min(len(tokens) - 1, result.common_prefix)
            if not can_trim_prompt_cache(entry.prompt_cache, len(result.longer) - prefix):
                if shorter > 0:
                    entry = self._trie.get(result.model, result.shorter)
                    return copy.deepcopy(entry.prompt_cache), tokens[shorter:]
                return None, tokens
        return super().fetch_nearest_cache(model, tokens)

    def insert_cache(self, model: Any, tokens: list[int], prompt_cache: list, *,
                     cache_type: str = "assistant"):
        tokens = tokens[: tokens_held(prompt_cache, len(tokens))]
        # A later fetch of a prefix of length p finds this entry and trims
        # it by len(tokens) - (p - 1) (fetch_nearest_cache keeps the
        # prompt's last token to process).
        self._trie.replaceable = lambda p: can_trim_prompt_cache(prompt_cache, len(tokens) - p + 1)
        try:
            super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
        finally:
            self._trie.replaceable = None

    def entry(self, model: Any, tokens: list[int]):
        """The entry (``prompt_cache``, ``nbytes``, ``cache_type``) stored
        under exactly ``tokens``, or None."""
        try:
            return self._trie.get(model, tokens)
        except KeyError:
            return None

    def remove(self, model: Any, tokens: list[int]) -> bool:
        """Drop the entry stored under exactly ``tokens``, as the store drops
        one it evicts; False when there is none."""
        entry = self.entry(model, tokens)
        if entry is None:
            return False
        self._trie.pop(model, tokens)
        self._n_bytes -= entry.nbytes
        self._n_bytes_by_type[entry.cache_type] -= entry.nbytes
        self._lru.remove(model, list(tokens))
        return True


__all__ = ["LRUPromptCache", "can_trim_prompt_cache", "tokens_held"]

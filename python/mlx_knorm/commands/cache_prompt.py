"""``mlx-knorm cache-prompt``: ``mlx_lm.cache_prompt``'s ``main`` with eviction caches.

mlx-lm prefills the prompt into ``make_prompt_cache(model)``, which is now
``make_knorm_cache(model, ...)``, and saves it with ``save_prompt_cache``
and the same metadata (``model``, ``tokenizer_config``). Each evicting layer
stores its kept rows (``L2NormKVCache.state``): at most ``budget`` per head,
however long the prompt. ``save_prompt_cache`` is wrapped to print the KV
memory line first and to write the file atomically (``mlx_knorm.atomic``:
a save that fails part way leaves the file there before as it was);
``mlx-knorm generate --prompt-cache-file`` reads the file.
"""

from __future__ import annotations

import importlib

from ..atomic import atomic_path
from .memory import kv_memory_line
from .session import Session

mlx_lm_cache_prompt = importlib.import_module("mlx_lm.cache_prompt")
SUFFIX = ".safetensors"

DESCRIPTION = """\
mlx_lm.cache_prompt with L2-norm KV-cache eviction: the saved cache keeps at
most --budget rows per head in each attention layer, so a long document becomes
a small file. Answer from it with mlx-knorm generate --prompt-cache-file FILE
(a stock mlx_lm.generate cannot read it: it does not know L2NormKVCache)."""


def main(argv: list[str]) -> int:
    session = Session("cache-prompt", mlx_lm_cache_prompt, DESCRIPTION)
    save = mlx_lm_cache_prompt.save_prompt_cache

    def save_prompt_cache(file_name, cache, metadata=None):
        print(kv_memory_line(cache))
        # Atomically, under the name mlx-lm's save gives it (mx.save_safetensors
        # appends the suffix a name lacks), which generate's load reads.
        target = str(file_name) if str(file_name).endswith(SUFFIX) else f"{file_name}{SUFFIX}"
        with atomic_path(target, suffix=SUFFIX) as temporary:
            save(str(temporary), cache, metadata)

    return session.run(argv, save_prompt_cache=save_prompt_cache)

"""``L2NormKVCache(...)`` built directly: without ``recent`` it takes the
reference's 0 (the paper's rule alone) and says so, so that no documented
path gives that policy silently; ``make_knorm_cache`` and an explicit
``recent`` build quietly."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import mlx.core as mx
import pytest

from tiny_models import tiny_model

from mlx_knorm.cache import L2NormKVCache, make_knorm_cache
from mlx_knorm.defaults import default_recent


def test_built_without_recent_it_warns_that_this_is_the_paper_s_rule():
    with pytest.warns(UserWarning, match=r"without recent keeps no recent window \(recent=0") as caught:
        cache = L2NormKVCache(budget=64, n_sink=4)
    assert cache.recent == 0
    message = str(caught[0].message)
    assert "make_knorm_cache(model, budget)" in message and "recent=default_recent(budget, n_sink)" in message
    # Pointed at the caller's line, not the constructor's.
    assert caught[0].filename == __file__


@pytest.mark.parametrize("scorer, says", [
    ("knorm", "the paper's rule alone), which cost 47x"),
    ("keydiff", "the keydiff scores alone), which cost 16x"),
    (lambda k, v, s: (mx.zeros(k.shape[:3]), None), "the <lambda> scores alone), which costs far more"),
])
def test_the_warning_names_the_rule_of_the_caches_scorer(scorer, says):
    with pytest.warns(UserWarning) as caught:
        L2NormKVCache(budget=64, n_sink=4, scorer=scorer)
    assert says in str(caught[0].message)


def filled(cache):
    cache.update_and_fetch(mx.zeros((1, 2, 3, 8)), mx.zeros((1, 2, 3, 8)))
    return cache


def reloaded(cache):
    from tempfile import TemporaryDirectory

    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    with TemporaryDirectory() as where:
        save_prompt_cache(f"{where}/c.safetensors", [cache])
        return load_prompt_cache(f"{where}/c.safetensors")


@pytest.mark.parametrize("build", [
    lambda: L2NormKVCache(budget=64, recent=0),
    lambda: L2NormKVCache(budget=64, recent=default_recent(64, 4)),
    # The reference's config object names its window (veloxquant_mlx's has knorm_recent = 0).
    lambda: L2NormKVCache(SimpleNamespace(knorm_budget=64, knorm_recent=0)),
    lambda: make_knorm_cache(tiny_model("llama", layers=2), budget=64),
    lambda: L2NormKVCache(budget=64, recent=0).to_quantized(group_size=32),
    lambda: L2NormKVCache.merge([filled(L2NormKVCache(budget=8, recent=0))]).extract(0),
    lambda: reloaded(filled(L2NormKVCache(budget=8, recent=0))),
])
def test_a_cache_whose_window_was_chosen_builds_quietly(build):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build()


def test_the_window_asked_for_is_the_one_kept():
    assert L2NormKVCache(budget=64, n_sink=4, recent=default_recent(64, 4)).recent == 32
    assert [c.recent for c in make_knorm_cache(tiny_model("llama", layers=2), budget=64)] == [32, 32]


def test_bad_settings_raise_before_any_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="budget"):
            L2NormKVCache(budget=0)

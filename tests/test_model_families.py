"""Every mlx-lm 0.32.2 model file with ``make_knorm_cache`` (docs/spec.md §8,
model families): a tiny model of each (tests/mlx_lm_configs.json), float32,
at B = 1 and B = 2. Under the budget the logits equal mlx-lm's own cache's,
bit for bit; past it they are finite and in shape, and every eviction cache
holds at most ``budget`` rows, through a prefill, single steps and an exact
small block. A family the cache cannot serve is refused with a message
naming it; one whose own mlx-lm cache cannot run on this CPU is checked to
fail as docs/models.md says (one that crashes the process now and then is
skipped, with the reason). docs/models.md's table is this file's."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlx_knorm.cache import L2NormKVCache, layer_caches, make_knorm_cache, model_family

from model_families import (CANNOT_IMPORT, CANNOT_RUN_ON_CPU, CRASHES_ON_CPU, DOC, FAMILIES, all_rows, build,
                            feed, generated, model_files)

# A prefill, a single step, an exact small block (past the budget), a single step.
BLOCKS = [5, 1, 3, 1]
BUDGET = 4
ON_CPU = not mx.metal.is_available()


# Below every family's vocabulary (nanochat's tiny configuration has 32 tokens).
VOCAB = 32


def prompts(batch: int) -> mx.array:
    return mx.array([[(7 * b + 3 * i + 1) % VOCAB for i in range(sum(BLOCKS))] for b in range(batch)])


def logits_of(model, cache, ids: mx.array, check=None) -> list[mx.array]:
    return feed(model, cache, ids, BLOCKS, check)


def test_every_model_file_has_a_tiny_configuration():
    assert model_files() == sorted({*FAMILIES, *CANNOT_IMPORT})


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_family_runs_as_with_mlx_lm_s_cache_or_is_refused_by_name(family):
    if ON_CPU and family in CRASHES_ON_CPU:
        # Not every time, so not checked: a crash would take this process with it.
        pytest.skip(f"mlx-lm's own cache cannot run {family} on a CPU: {CANNOT_RUN_ON_CPU[family]}")
    if ON_CPU and family in CANNOT_RUN_ON_CPU:
        # Recorded in docs/models.md; fails when it no longer holds.
        model = build(family)
        with pytest.raises(RuntimeError, match="Metal"):
            logits_of(model, make_prompt_cache(model), prompts(1))
        with pytest.raises(ValueError, match=f"cannot serve this {model_family(model)} model here"):
            make_knorm_cache(model, budget=BUDGET, n_sink=1, recent=1)
        return
    model = build(family)
    try:
        make_knorm_cache(model, budget=64, n_sink=1)
    except ValueError as err:
        assert f"cannot serve this {model_family(model)} model" in str(err)
        return
    for batch in (1, 2):
        ids = prompts(batch)
        expected = logits_of(model, make_prompt_cache(model), ids)
        got = logits_of(model, make_knorm_cache(model, budget=64, n_sink=1), ids)
        for block, (a, b) in enumerate(zip(got, expected)):
            assert a.shape == b.shape and mx.array_equal(a, b).item(), f"B={batch}, block {block}"

        cache = make_knorm_cache(model, budget=BUDGET, n_sink=1, recent=1)
        ours = [c for c in layer_caches(cache) if isinstance(c, L2NormKVCache)]
        assert ours

        def check(logits, size):
            assert logits.shape == (batch, size, expected[0].shape[-1])
            assert mx.all(mx.isfinite(logits)).item()
            for layer in ours:
                assert layer.size() <= BUDGET and layer.state[0].shape[2] <= BUDGET

        logits_of(model, cache, ids, check)
        assert all(layer.offset == sum(BLOCKS) for layer in ours)


@pytest.mark.skipif(not ON_CPU, reason="docs/models.md is generated on a CPU (the Metal-only families differ)")
def test_docs_models_table_is_current():
    assert generated(all_rows()) == DOC.read_text(), "run: python tests/model_families.py"

"""Scorers under hostile use: filters that do not fit a model are refused
before any cache changes, states a scorer's cache holds read back (keydiff's
scores of tiny keys included), tampered scorer fields are refused on every
kind of cache, a converted keydiff cache does not trim past its conversion
after a reload, and the commands refuse bad filters before loading a model."""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from mlx_knorm.batch_cache import BatchL2NormKVCache
from mlx_knorm.cache import L2NormKVCache, QuantizedL2NormKVCache, make_knorm_cache
from mlx_knorm.cache_state import StateError
from mlx_knorm.commands.session import load_filters
from mlx_knorm.scorers import QueryFilters
from tiny_models import tiny_model, tokens

HEADS, DIM = 2, 16


def fed(cache, keys, values=None, blocks=None):
    values = keys if values is None else values
    start = 0
    for size in blocks or [keys.shape[2]]:
        cache.update_and_fetch(keys[:, :, start : start + size], values[:, :, start : start + size])
        start += size
    mx.eval(cache.norms)
    return cache


def test_filters_that_do_not_fit_a_layer_are_refused_before_any_cache_exists():
    model = tiny_model("llama", layers=3)
    heads, dim = model.args.num_key_value_heads, model.args.hidden_size // model.args.num_attention_heads
    good = np.eye(heads, dim, dtype=np.float32)
    wide = np.eye(heads, dim + 16, dtype=np.float32)
    filters = QueryFilters({0: good, 1: wide, 2: good})
    with pytest.raises(ValueError, match=rf"query filters of layer 1 are \[{heads}, {dim + 16}\].*calibrate"):
        make_knorm_cache(model, budget=8, scorer="qfilter", filters=filters)
    fitting = make_knorm_cache(model, budget=8, scorer="qfilter", filters=QueryFilters({i: good for i in range(3)}))
    model(tokens(1, 12), cache=fitting)
    assert [c.offset for c in fitting] == [12, 12, 12]


def test_a_keydiff_cache_of_tiny_keys_reads_its_own_state_back(tmp_path):
    """A key whose components sit near 2^-63 loses squares to §2a's flush in
    its norm but not in its dot product, so it scores above 1; once rows are
    evicted the load check holds scores to ±(D + 1), which such a state
    meets."""
    for dtype in (mx.float32, mx.bfloat16):
        base = mx.concatenate([mx.zeros((1,)), mx.ones((DIM - 1,))])
        rows = [base * (1 + 0.01 * i) for i in range(11)]
        rows.append(mx.concatenate([mx.array([1.1e-19]), mx.full((DIM - 1,), 1.0e-19)]))
        keys = mx.stack(rows)[None, None].astype(dtype)
        keys = mx.concatenate([keys, keys], axis=1)
        cache = L2NormKVCache(budget=8, n_sink=1, recent=2, scorer="keydiff")
        fed(cache, keys)
        fed(cache, keys[:, :, :1])
        assert mx.max(cache.state[2]).item() > 1  # the tiny key's score
        L2NormKVCache(budget=8, n_sink=1, recent=2, scorer="keydiff").state = cache.state
        save_prompt_cache(str(tmp_path / "k.safetensors"), [cache])
        (loaded,) = load_prompt_cache(str(tmp_path / "k.safetensors"))
        assert np.array_equal(np.array(loaded.state[2]), np.array(cache.state[2]))


def test_a_converted_keydiff_cache_trims_no_further_back_after_a_reload(tmp_path):
    """Its running sum comes from the float rows before to_quantized, which
    the quantized rows cannot rebuild: a reload keeps trimmable() at 0."""
    rng = np.random.default_rng(0)
    keys = mx.array(rng.standard_normal((1, HEADS, 5, 64)).astype(np.float32))
    converted = fed(L2NormKVCache(budget=8, n_sink=1, recent=2, scorer="keydiff"), keys).to_quantized(bits=4)
    assert converted.trimmable() == 0
    save_prompt_cache(str(tmp_path / "q.safetensors"), [converted])
    (loaded,) = load_prompt_cache(str(tmp_path / "q.safetensors"))
    assert loaded.trimmable() == 0 and loaded.trim(2) == 0 and loaded.offset == 5
    # A quantized keydiff cache still trims the updates it scored itself.
    more = mx.array(rng.standard_normal((1, HEADS, 3, 64)).astype(np.float32))
    fed(loaded, more)
    assert loaded.trimmable() == 3 and loaded.trim(2) == 2


@pytest.mark.parametrize("field", ["keydiff sum width", "keydiff sum None", "qfilter width"])
def test_a_quantized_state_with_scorer_fields_that_do_not_fit_is_refused(field):
    rng = np.random.default_rng(1)
    keys = mx.array(rng.standard_normal((1, HEADS, 6, 64)).astype(np.float32))
    scorer = field.split()[0]
    filters = mx.array(np.eye(HEADS, 64, dtype=np.float32)) if scorer == "qfilter" else None
    cache = fed(QuantizedL2NormKVCache(budget=8, n_sink=1, recent=2, scorer=scorer, filters=filters, bits=8), keys)
    state = list(cache.state)
    state[-1] = {"keydiff sum width": mx.zeros((1, HEADS, 80)), "keydiff sum None": None,
                 "qfilter width": mx.array(np.eye(HEADS, 80, dtype=np.float32))}[field]
    target = QuantizedL2NormKVCache(budget=8, n_sink=1, recent=2, bits=8)
    with pytest.raises(StateError, match="scorer_state"):
        target.state = state
    assert target.keys is None and target.scorer == "knorm"


def batch_state(scorer="keydiff", sequences=1, length=3, filters=None):
    rng = np.random.default_rng(2)
    singles = [fed(L2NormKVCache(budget=8, n_sink=1, recent=2, scorer=scorer, filters=filters),
                   mx.array(rng.standard_normal((1, HEADS, length, DIM)).astype(np.float32)))
               for _ in range(sequences)]
    return list(L2NormKVCache.merge(singles).state)


@pytest.mark.parametrize("tamper", ["a string", "NaN", "one more sequence", "other width", "qfilter NaN",
                                    "vnorm array"])
def test_a_batch_state_with_a_scorer_field_that_does_not_fit_is_refused(tamper):
    if tamper == "a string":
        state = batch_state(length=0)[:13] + ["keydiff", "junk"]
    elif tamper == "NaN":
        state = batch_state(length=0)[:13] + ["keydiff", mx.full((1, HEADS, DIM), float("nan"))]
    elif tamper == "one more sequence":
        state = batch_state()
        state[14] = mx.concatenate([state[14], mx.zeros((1, HEADS, DIM))])
    elif tamper == "other width":
        state = batch_state()
        state[14] = mx.zeros((1, HEADS, DIM + 1))
    elif tamper == "qfilter NaN":
        state = batch_state(length=0)[:13] + ["qfilter", mx.full((HEADS, DIM), float("nan"))]
    else:
        state = batch_state(length=0)[:13] + ["vnorm", mx.ones((3,))]
    target = BatchL2NormKVCache([0], budget=8, n_sink=1, recent=2, keep="low")
    with pytest.raises(ValueError, match="scorer_state"):
        target.state = state
    assert target.scorer == "knorm" and target.keys is None


def test_batches_join_only_caches_of_the_same_filters():
    def batch(sign):
        filters = sign * mx.array(np.eye(HEADS, DIM, dtype=np.float32))
        cache = L2NormKVCache(budget=8, n_sink=1, recent=2, scorer="qfilter", filters=filters)
        return fed(cache, mx.array(np.random.default_rng(3).standard_normal((1, HEADS, 3, DIM)).astype(np.float32)))

    with pytest.raises(ValueError, match="other query filters"):
        L2NormKVCache.merge([batch(1), batch(-1)])
    a, b = L2NormKVCache.merge([batch(1)]), L2NormKVCache.merge([batch(-1)])
    with pytest.raises(ValueError, match=r"extend: caches\[1\] ranks by other query filters"):
        a.extend(b)
    assert a.batch_size == 1


def test_a_users_scorer_is_held_to_its_contract():
    keys = mx.zeros((1, HEADS, 3, DIM))
    one_array = L2NormKVCache(budget=8, recent=2, scorer=lambda k, v, s: mx.zeros(k.shape[:3]))
    with pytest.raises(ValueError, match=r"must return \(scores, state\), got array"):
        one_array.update_and_fetch(keys, keys)
    assert one_array.offset == 0

    def tuple_state(k, v, s):
        return mx.zeros(k.shape[:3]), ("a", "tuple")

    caches = [fed(L2NormKVCache(budget=8, recent=2, scorer=tuple_state), keys) for _ in range(2)]
    with pytest.raises(ValueError, match=r"tuple_state\) batches only with a state that is None or an array"):
        L2NormKVCache.merge(caches)


@pytest.mark.parametrize("filters, error, says", [
    (np.eye(HEADS, DIM, dtype=np.float32), TypeError, "filters must be an mlx.core.array"),
    (mx.eye(HEADS, DIM).astype(mx.float16), ValueError, "filters must be finite float32"),
    (mx.full((HEADS, DIM), float("inf")), ValueError, "filters must be finite float32"),
    (mx.zeros((1, HEADS, DIM)), ValueError, "filters must be finite float32"),
])
def test_a_caches_filters_are_checked_naming_them(filters, error, says):
    with pytest.raises(error, match=says):
        L2NormKVCache(budget=8, recent=2, scorer="qfilter", filters=filters)


def test_the_commands_read_the_filters_once_and_refuse_bad_ones(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLX_KNORM_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="--scorer qfilter needs the model's query filters: run `mlx-knorm "
                                         "calibrate --model some/model`"):
        load_filters(None, "some/model", True, "mlx-knorm generate")
    assert load_filters(None, "some/model", False, "mlx-knorm generate") is None
    with pytest.raises(ValueError, match="--filters .*typo.*no query filters at"):
        load_filters(str(tmp_path / "typo.safetensors"), "some/model", False, "mlx-knorm server")
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="--filters .*corrupt"):
        load_filters(str(corrupt), "some/model", True, "mlx-knorm server")
    saved = QueryFilters({0: np.eye(HEADS, DIM, dtype=np.float32)}).save(tmp_path / "f.safetensors")
    assert isinstance(load_filters(str(saved), None, True, "mlx-knorm server"), QueryFilters)
    # An unreadable default file is reported, and ignored unless qfilter asks for it.
    from mlx_knorm.scorers import default_filters_path

    default = default_filters_path("some/model")
    default.parent.mkdir(parents=True)
    default.write_bytes(b"junk")
    with warnings.catch_warnings():
        assert load_filters(None, "some/model", False, "mlx-knorm server") is None
    assert "warning: ignoring the query filters at" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--filters"):
        load_filters(None, "some/model", True, "mlx-knorm server")


def test_generate_refuses_missing_filters_before_loading_the_model(tmp_path, capsys):
    from mlx_knorm.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model", str(tmp_path / "no-such-model"), "--scorer", "qfilter",
              "--filters", str(tmp_path / "typo.safetensors"), "--prompt", "hi"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--filters" in err and "no query filters at" in err and "Traceback" not in err


def test_local_models_get_their_own_default_filters_file(tmp_path, monkeypatch):
    from mlx_knorm.scorers import default_filters_path

    monkeypatch.setenv("MLX_KNORM_CACHE", str(tmp_path / "cache"))
    for folder in ("a/model", "b/model"):
        (tmp_path / folder).mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "a" / "model")
    paths = {default_filters_path("."), default_filters_path(str(tmp_path / "b" / "model")),
             default_filters_path("model")}
    assert len(paths) == 3  # "model" is no local path here: a repository's name
    assert default_filters_path(".") == default_filters_path(str(tmp_path / "a" / "model"))
    assert default_filters_path("smollm2").name == "smollm2.safetensors"
    assert all(p.parent == tmp_path / "cache" / "filters" and not p.name.startswith(".") for p in paths)

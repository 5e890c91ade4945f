"""The needle task: prompt construction, scoring, and the grid through real caches, on the shipped byte-level model.

The shipped model cannot find a needle (it was trained on 512-byte windows
of Python source); these tests check the machinery. tests/test_smollm2.py
runs the task on a real model.
"""

from __future__ import annotations

import argparse
import inspect
import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import KVCache, RotatingKVCache

from mlx_knorm.__main__ import main
from mlx_knorm.cache import L2NormKVCache
from mlx_knorm.quality import MODEL_DIR
from mlx_knorm.quality.needle import (KEY_DIGITS, answer, build_prompt, copy_caches, first_number, is_correct,
                                      make_haystack, make_keys, markdown_tables, needle_offset, plot, prefill,
                                      run_grid)
from mlx_knorm.quality.cli import needle_grid, register
from mlx_knorm.quality.policies import DEFAULT_POLICIES, Policy, RandomEvictionCache, policy_cache


@pytest.fixture(scope="module")
def shipped():
    return load(str(MODEL_DIR))


@pytest.mark.parametrize("name", ["passkey", "prose"])
def test_prompts_hold_the_needle_at_the_start_nearest_the_depth(shipped, name):
    _, tokenizer = shipped
    haystack = make_haystack(name, tokenizer, 900)
    needle = haystack.needle.format(key="48213")
    longest = max(len(s) for s in tokenizer.decode(list(haystack.filler)).split("\n" if name == "prose" else "."))
    for depth in (0.0, 0.3, 0.5, 1.0):
        prompt = build_prompt(haystack, tokenizer, 900, depth, "48213")
        # Short of the context by less than one line (prose) or sentence (passkey), plus its separator.
        assert 900 - longest - 2 <= len(prompt.tokens) <= 900
        text = tokenizer.decode(list(prompt.tokens))
        assert text.count(needle) == 1 and text.startswith(tokenizer.decode(list(haystack.intro)))
        assert text.endswith(tokenizer.decode(list(haystack.question)))
        assert prompt.tokens[prompt.needle_at : prompt.needle_at + len(needle)] == tuple(needle.encode())
        at = prompt.needle_at - len(haystack.intro)
        end = len(prompt.tokens) - len(haystack.intro) - len(needle) - len(haystack.question)
        before = tokenizer.decode(list(haystack.filler[:at]))
        if 0 < at < end:
            assert at in haystack.starts
            assert before.endswith("\n\n") if name == "prose" else before.rstrip()[-1] in ".!?"
        # No start lies nearer the depth.
        starts = [0, end] + [b for b in haystack.starts if b < end]
        assert abs(at - depth * end) <= min(abs(b - depth * end) for b in starts)
        # What precedes the question is whole.
        filler = tokenizer.decode(list(haystack.filler[:at])) + tokenizer.decode(list(haystack.filler[at:end]))
        assert filler.endswith("\n") if name == "prose" else filler.rstrip().endswith(".")
    assert build_prompt(haystack, tokenizer, 900, 0.0, "1").needle_at == len(haystack.intro)


def test_depth_ends_and_bad_prompts(shipped):
    _, tokenizer = shipped
    haystack = make_haystack("passkey", tokenizer, 300)
    assert needle_offset(haystack, 200, 0.0) == 0 and needle_offset(haystack, 200, 1.0) == 200
    with pytest.raises(ValueError, match="depth"):
        build_prompt(haystack, tokenizer, 300, 1.5, "12345")
    with pytest.raises(ValueError, match="filler tokens"):
        build_prompt(haystack, tokenizer, 5000, 0.5, "12345")
    with pytest.raises(ValueError, match="filler tokens"):
        build_prompt(haystack, tokenizer, len(haystack.intro) + 80, 0.5, "12345")
    with pytest.raises(ValueError, match="haystack must be one of"):
        make_haystack("hay", tokenizer, 300)


def test_scoring_takes_the_first_number():
    assert is_correct(" 48213.", "48213") and is_correct("48213", "48213")
    assert not is_correct(" 4821.", "48213") and not is_correct(" 482134", "48213")
    assert not is_correct(" the key is 7 and 48213", "48213") and not is_correct(" none", "48213")
    assert first_number("no digits") is None
    keys = make_keys(np.random.default_rng(0), 50)
    assert all(len(k) == KEY_DIGITS and k[0] != "0" for k in keys) and len(set(keys)) > 40


@pytest.mark.parametrize("policy", [None, "window", "keep-low+recent=1/4", "random"])
def test_copied_caches_continue_as_the_originals_and_leave_them_alone(shipped, policy):
    model, _ = shipped
    policy = None if policy is None else Policy.parse(policy)
    ids = [int(i) for i in np.random.default_rng(1).integers(32, 127, size=96)]
    caches = policy_cache(model, policy, 24, 96)
    prefill(model, caches, ids[:64], 16)
    before = [[mx.array(a) for a in c.state if isinstance(a, mx.array)] for c in caches]
    first, second = copy_caches(caches), copy_caches(caches)
    outs = [model(mx.array(ids[64:80])[None], cache=c) for c in (first, second)]
    for c in (first, second):
        mx.eval(model(mx.array(ids[80:81])[None], cache=c))
    assert mx.array_equal(*outs).item()
    for cache, saved in zip(caches, before):
        now = [a for a in cache.state if isinstance(a, mx.array)]
        assert all(mx.array_equal(a, b).item() for a, b in zip(now, saved))
    assert all(c.offset == 64 for c in caches) and all(c.offset == 81 for c in first)


@pytest.mark.parametrize("policy", [None, "window", "keep-low", "keep-high+recent=1/2", "keep-low+skip=0"])
def test_a_trial_is_generate_step_on_the_whole_prompt(shipped, policy):
    """Snapshot, copy, rest of the prompt: the answer generate_step gives on the whole prompt from empty caches."""
    model, tokenizer = shipped
    parsed = None if policy is None else Policy.parse(policy)
    context, depth, step = 320, 0.5, 48
    grid = run_grid(model, tokenizer, haystacks=("passkey",), contexts=(context,), depths=(depth,),
                    fractions=(0.5,), policies=[] if parsed is None else [parsed], keys=2,
                    prefill_step_size=step, full=parsed is None)
    keys = make_keys(np.random.default_rng(0), 2)
    haystack = make_haystack("passkey", tokenizer, context)
    assert [t.key for t in grid.trials] == keys
    for trial, key in zip(grid.trials, keys):
        prompt = build_prompt(haystack, tokenizer, context, depth, key)
        assert prompt.needle_at > step  # the trial starts from a snapshot
        caches = policy_cache(model, parsed, 160, context)
        assert trial.answer == answer(model, tokenizer, prompt.tokens, caches, step, KEY_DIGITS + 3)
        assert trial.policy == (policy or "full") and trial.budget == (None if parsed is None else 160)
    assert grid.prefill_tokens < 2 * context  # the haystack before the needle was read once


def test_the_grid_runs_every_policy_through_its_real_cache_and_writes_json_and_a_plot(tmp_path, capsys):
    out, png = tmp_path / "needle.json", tmp_path / "needle.png"
    argv = ["needle", "--model", str(MODEL_DIR), "--full-grid", "--contexts", "400", "--depths", "0,1",
            "--budgets", "0.25", "--keys", "2", "--prefill-step-size", "64", "--json", str(out), "--plot", str(png)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "**passkey**" in printed and "**prose**" in printed and "prompt tokens read by the caches" in printed
    report = json.loads(out.read_text())
    # Layers 0 and 1 of the 4 take the whole context, more than a quarter of the memory: no skip policies.
    ran = {"full", "keep-low", "keep-high", "window", "random", "keep-low+recent=1/4", "keep-low+recent=1/2"}
    assert {t["policy"] for t in report["trials"]} == ran
    assert len(report["trials"]) == 2 * 7 * 2 * 2  # haystacks x policies x depths x keys
    assert all(cell["trials"] == 2 and 0 <= cell["ci"][0] <= cell["accuracy"] <= cell["ci"][1] <= 1
               for cell in report["cells"])
    assert report["keys"] == 2 and report["prefill_step_size"] == 64 and report["timing"]["seconds"] > 0
    assert png.stat().st_size > 0


def test_the_default_grid_is_the_small_one_and_the_full_grid_is_one_flag_away():
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())

    def grid(*argv):
        found = needle_grid(parser.parse_args(["needle", *argv]))
        return found["haystacks"], [p.name for p in found["policies"]], found["keys"]

    small = (["passkey"], ["keep-low", "window", "keep-low+recent=1/2"], 1)
    assert grid() == small
    assert grid("--full-grid") == (["passkey", "prose"], [p.name for p in DEFAULT_POLICIES], 4)
    assert grid("--full-grid", "--keys", "2", "--haystacks", "prose")[::2] == (["prose"], 2)
    assert grid("--policies", "random")[1] == ["random"]
    defaults = {k: v.default for k, v in inspect.signature(run_grid).parameters.items()}
    assert (list(defaults["haystacks"]), [p.name for p in defaults["policies"]], defaults["keys"]) == small


def test_random_caches_of_a_trial_draw_their_own_evictions(shipped):
    model, tokenizer = shipped
    grid = run_grid(model, tokenizer, haystacks=("prose",), contexts=(200,), depths=(0.0,), fractions=(0.25,),
                    policies=["random"], keys=1, prefill_step_size=32, full=False)
    again = run_grid(model, tokenizer, haystacks=("prose",), contexts=(200,), depths=(0.0,), fractions=(0.25,),
                     policies=["random"], keys=1, prefill_step_size=32, full=False, seed=0)
    assert [t.answer for t in grid.trials] == [t.answer for t in again.trials]  # reproducible for a seed
    caches = policy_cache(model, Policy("random"), 50, 200)
    assert all(isinstance(c, RandomEvictionCache) for c in caches)


def test_bad_grid_arguments_are_named(shipped):
    model, tokenizer = shipped
    for kwargs, match in [({"keys": 0}, "keys"), ({"prefill_step_size": 0}, "prefill_step_size"),
                          ({"fractions": (1.0,)}, "budget fractions"), ({"depths": (2.0,)}, "depths"),
                          ({"policies": ["oldest"]}, "score")]:
        with pytest.raises(ValueError, match=match):
            run_grid(model, tokenizer, contexts=(200,), **kwargs)


def test_markdown_tables_and_plot_from_a_small_grid(shipped, tmp_path):
    model, tokenizer = shipped
    grid = run_grid(model, tokenizer, haystacks=("passkey",), contexts=(320,), depths=(1.0,), fractions=(0.5,),
                    policies=["keep-low"], keys=1, prefill_step_size=64)
    table = markdown_tables(grid)
    assert "| full | — |" in table and "| keep-low | 1/2 |" in table
    plot(grid, str(tmp_path / "grid.png"), "shipped")
    assert {type(c) for c in policy_cache(model, None, 8, 160)} == {KVCache}
    assert {type(c) for c in policy_cache(model, Policy("window"), 8, 160)} == {RotatingKVCache}
    assert {type(c) for c in policy_cache(model, Policy("keep-low"), 8, 160)} == {L2NormKVCache}

"""``mlx-knorm generate`` on the families whose later layers share an earlier
layer's cache (gemma3n, afm7: docs/spec.md §8, KV sharing), as model
directories a user has: within the budget it prints what ``mlx_lm generate``
prints, past it it goes on at the budget; a family the cache cannot serve
stops the command with the refusal, not a traceback, and the server answers
each request with it and keeps serving."""

from __future__ import annotations

import json

import pytest

from command_runs import MLX_KNORM, MLX_LM, command_env, evicting, kv_lines, mlx_lm_stat, run, succeeded
from model_families import write_model_dir
from test_command_server import Server

PROMPT = "hello there"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return command_env(tmp_path_factory.mktemp("home"))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {family: write_model_dir(family, root / family) for family in ("gemma3n", "afm7", "mamba")}


@pytest.mark.parametrize("family", ["gemma3n", "afm7"])
def test_a_sharing_family_generates_as_mlx_lm_within_the_budget_and_goes_on_past_it(family, models, env):
    args = ["--model", models[family], "--prompt", PROMPT, "--max-tokens", "30", "--verbose", "F"]
    ours = succeeded(run([*MLX_KNORM, "generate", *args, "--budget", "512"], env))
    theirs = succeeded(run([*MLX_LM, "generate", *args], env))
    assert ours.stdout == theirs.stdout and ours.stdout.strip()

    out = succeeded(run([*MLX_KNORM, "generate", "--model", models[family], "--prompt", PROMPT,
                         "--max-tokens", "40", "--budget", "8"], env)).stdout
    assert mlx_lm_stat(out, "Generation") == 40
    [line] = kv_lines(out)
    assert evicting(line, 8) and line["tokens"] > 8 and line["held_mb"] < line["full_mb"]


def test_a_family_the_cache_cannot_serve_is_refused_by_name(models, env):
    result = run([*MLX_KNORM, "generate", "--model", models["mamba"], "--prompt", PROMPT, "--budget", "8"], env)
    assert result.returncode != 0
    assert "cannot serve this mamba model" in result.stderr and "Traceback" not in result.stderr


def test_the_server_answers_a_family_it_cannot_serve_with_the_refusal_and_keeps_serving(models, env, tmp_path):
    server = Server([*MLX_KNORM, "server", "--model", models["mamba"], "--budget", "8"], env, tmp_path / "log")
    try:
        for _ in range(2):
            status, raw = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
            assert status == 404 and "cannot serve this mamba model" in json.loads(raw)["error"]
        assert server.get("/health")[0] == 200
        assert "Traceback" not in server.log_text()
    finally:
        server.stop()

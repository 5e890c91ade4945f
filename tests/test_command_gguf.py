"""mlx-knorm's commands on a GGUF file, as a user runs them: ``generate``
gives the tokens of ``mlx_lm.generate`` on the directory ``mlx-knorm
convert`` writes from the same file while the prompt and the generation fit
in the budget (past it, generation goes on and the KV memory stays at the
budget); ``chat``, ``cache-prompt`` with ``generate --prompt-cache-file``,
and ``server`` answer on the file what they answer on its conversion."""

from __future__ import annotations

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from command_runs import MLX_KNORM, MLX_LM, command_env, evicting, kv_lines, mlx_lm_stat, run, succeeded  # noqa: E402
from tiny_gguf import write_model  # noqa: E402

PROMPT = "the tin man"


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory):
    """A tiny llama GGUF file (Q8_0 weights, as llama.cpp writes them) and
    the mlx-lm directory converted from it."""
    root = tmp_path_factory.mktemp("gguf-command")
    path = write_model(root / "tiny-llama-Q8_0.gguf", "llama", Q.Q8_0).path
    env = command_env(root / "home")
    succeeded(run([*MLX_KNORM, "convert", path, root / "converted"], env))
    return path, root / "converted", env


def test_generate_on_a_gguf_file_prints_what_mlx_lm_prints_for_its_conversion(gguf_model):
    path, converted, env = gguf_model
    flags = ["--prompt", PROMPT, "--max-tokens", "40", "--verbose", "F"]
    ours = succeeded(run([*MLX_KNORM, "generate", "--model", path, "--budget", "512", *flags], env))
    theirs = succeeded(run([*MLX_LM, "generate", "--model", converted, *flags], env))
    assert ours.stdout == theirs.stdout
    assert len(ours.stdout.strip()) > 0


def test_generate_on_a_gguf_file_past_the_budget_keeps_the_budget(gguf_model):
    path, _, env = gguf_model
    budget = 24
    out = succeeded(run([*MLX_KNORM, "generate", "--model", path, "--prompt", PROMPT, "--max-tokens", "50",
                         "--budget", budget], env)).stdout
    assert mlx_lm_stat(out, "Generation") == 50
    [line] = kv_lines(out)
    assert evicting(line, budget)
    assert line["tokens"] == mlx_lm_stat(out, "Prompt") + 50 > budget
    assert 0 < line["held_mb"] < line["full_mb"]


def test_chat_on_a_gguf_file_is_chat_on_its_conversion(gguf_model):
    path, converted, env = gguf_model
    turns = "the tin man\nand the lion\nq\n"
    flags = ["--max-tokens", "16", "--budget", "512"]
    ours = succeeded(run([*MLX_KNORM, "chat", "--model", path, *flags], env, stdin=turns)).stdout
    theirs = succeeded(run([*MLX_KNORM, "chat", "--model", converted, *flags], env, stdin=turns)).stdout
    assert _answers(ours) == _answers(theirs) and _answers(ours).strip()
    assert len(kv_lines(ours)) == 2


def _answers(chat_output: str) -> str:
    """The turns' text: without the banner box (it names the model path) and
    the lines whose figures vary between runs (speeds, KV memory)."""
    from test_commands import _strip

    return "\n".join(line for line in _strip(chat_output).splitlines()
                     if not line.lstrip().startswith(("│", "╭", "╰", "├")))


def test_a_prompt_cache_of_a_gguf_file_answers_as_its_conversion_s(gguf_model, tmp_path):
    path, converted, env = gguf_model
    answers = []
    for model in (path, converted):
        cache_file = tmp_path / f"{len(answers)}.safetensors"
        succeeded(run([*MLX_KNORM, "cache-prompt", "--model", model, "--budget", "32",
                       "--prompt", PROMPT * 8, "--prompt-cache-file", cache_file], env))
        answers.append(succeeded(run([*MLX_KNORM, "generate", "--prompt-cache-file", cache_file, "--model", model,
                                      "--prompt", " and", "--max-tokens", "20", "--verbose", "F"], env)).stdout)
    assert answers[0] == answers[1] and answers[0].strip()


def test_the_server_serves_a_gguf_file(gguf_model, tmp_path):
    from test_command_server import Server

    path, converted, env = gguf_model
    server = Server([*MLX_KNORM, "server", "--model", path, "--budget", "512"], env, tmp_path / "server.log")
    try:
        body = {"prompt": PROMPT, "max_tokens": 20}
        text = server.complete("/v1/completions", body)["choices"][0]["text"]
        streamed = "".join(e["choices"][0]["text"] for e in server.stream("/v1/completions", body))
    finally:
        server.stop()
    from mlx_lm import generate, load

    model, tokenizer = load(str(converted))
    expected = generate(model, tokenizer, PROMPT, max_tokens=20)
    assert text == streamed == expected and text.strip()

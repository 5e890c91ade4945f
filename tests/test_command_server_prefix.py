"""The server's prefix reuse, measured (docs/spec.md §8, trim): a follow-up
request that shares a prefix with a stored conversation held under the
budget reprocesses only its new tokens (the stored cache is trimmed back
to the shared prefix, exactly, call after call); past the budget a cache
that has evicted is not trimmed back, and the request is answered from a
fresh cache."""

from __future__ import annotations

import pytest

from command_runs import MLX_KNORM, command_env, write_tiny_llama
from test_command_server import Server

BUDGET = 256
# The tiny llama's tokenizer is byte-level: a character is a token.
STORED = "def read_config(path):\n    with open(path) as f:\n        return f.read()\n\n\n"  # 75
NEW = "def write_config(path, text):\n"  # 30


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    model = write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")
    s = Server([*MLX_KNORM, "server", "--model", model, "--budget", BUDGET], command_env(home),
               tmp_path_factory.mktemp("logs") / "server.log")
    yield s
    s.stop()


def processed(server: Server, prompt: str, max_tokens: int = 8) -> tuple[int, int, str]:
    """(prompt tokens, tokens taken from a stored cache, the answer)."""
    answer = server.complete("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens})
    usage = answer["usage"]
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], answer["choices"][0]["text"]


def test_a_follow_up_under_the_budget_reprocesses_only_its_new_tokens(server):
    stored = STORED * 3  # 225 tokens, under the budget with the answer's 8
    total, cached, _ = processed(server, stored)
    assert (total, cached) == (len(stored), 0)
    # Leaving the stored conversation part way: its cache is trimmed back to
    # the shared prefix, and only the new tokens are processed.
    for shared in (200, 120):
        total, cached, _ = processed(server, stored[:shared] + NEW)
        assert (total, cached) == (shared + len(NEW), shared)


def test_past_the_budget_a_cache_that_evicted_is_not_trimmed_back(server):
    long = "".join(f"value_{i} = {i}\n" for i in range(25))  # 330 tokens
    processed(server, long)
    total, cached, _ = processed(server, long[:200] + NEW)
    assert (total, cached) == (200 + len(NEW), 0)

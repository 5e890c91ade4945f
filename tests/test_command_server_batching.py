"""``mlx-knorm server`` batches concurrent requests with eviction caches
(docs/spec.md §8, batches): several HTTP clients at once, with prompts of
different lengths (some past the budget), get the answers each gets alone;
requests with other cache settings, or settings that cannot batch
(``skip_layers``), are served too, with their own answers."""

from __future__ import annotations

import re

import pytest

from command_runs import MLX_KNORM, command_env
from mlx_knorm.quality import MODEL_DIR
from test_command_server import LONG_PROMPT, PROMPT, Server, at_once, text_of

BUDGET = 64
PROMPTS = [PROMPT, LONG_PROMPT, "class Config:\n    ", LONG_PROMPT[: len(LONG_PROMPT) // 3] + "def load(path):\n"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    env = command_env(tmp_path_factory.mktemp("home"))
    s = Server([*MLX_KNORM, "server", "--model", MODEL_DIR, "--budget", BUDGET, "--prompt-cache-size", 0],
               env, tmp_path_factory.mktemp("logs") / "mlx-knorm-server.log")
    yield s
    s.stop()


def batch_sizes(log: str) -> list[int]:
    return [int(n) for n in re.findall(r"mlx-knorm: batching (\d+) requests", log)]


def test_concurrent_requests_are_batched_and_answer_as_alone(server):
    bodies = [{"prompt": p, "max_tokens": 24 + 4 * i} for i, p in enumerate(PROMPTS)]
    alone = [text_of(server.complete("/v1/completions", body)) for body in bodies]
    before = len(batch_sizes(server.log_text()))
    assert at_once(server, bodies * 2) == alone * 2
    assert max(batch_sizes(server.log_text())[before:]) >= 2, "the requests were never batched"


def test_other_settings_and_unbatchable_settings_are_served_with_their_own_answers(server):
    bodies = [
        {"prompt": LONG_PROMPT, "max_tokens": 20},
        {"prompt": LONG_PROMPT, "max_tokens": 20, "budget": 32, "recent": 0},
        {"prompt": LONG_PROMPT, "max_tokens": 20, "skip_layers": [0]},
        {"prompt": PROMPT, "max_tokens": 20, "budget": 32},
    ]
    alone = [text_of(server.complete("/v1/completions", body)) for body in bodies]
    assert alone[0] != alone[1], "a smaller budget without a recent window should change this answer"
    assert at_once(server, bodies) == alone
    # The server still serves, and logs each request's statistics.
    assert text_of(server.complete("/v1/completions", bodies[0])) == alone[0]
    assert "Generation: 20 tokens" in server.log_text()

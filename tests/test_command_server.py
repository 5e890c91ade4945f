"""``mlx-knorm server`` started as a user starts it, on 127.0.0.1 on a free
port, with real HTTP requests: streaming and not, several clients at once,
bad requests (answered as a stock ``mlx_lm.server`` started next to it
answers them), prefix reuse, memory past the budget. Each test module's
servers are stopped by their process ids."""

from __future__ import annotations

import json
import re
import socket
import sys
import threading
import time

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate
from mlx_lm.models.cache import trim_prompt_cache

from command_runs import (
    MLX_KNORM,
    MLX_LM,
    WIDE_HEAD_DIM,
    command_env,
    evicting,
    kv_lines,
    mb,
    run,
    tiny_kv_bytes,
    write_tiny_llama,
)
from mlx_knorm.bench.server_process import ServerProcess, free_port
from mlx_knorm.quality import MODEL_DIR

BUDGET = 128
START_TIMEOUT_S = 120
REQUEST_TIMEOUT_S = 120
PROMPT = "import os\nimport sys\n\n\ndef main():\n    "
LONG_PROMPT = '"""Helpers for reading configuration files."""\n\nimport os\n\n\n' * 10


class Server(ServerProcess):
    """A server command on a free loopback port (mlx_knorm.bench.server_process); ``stop()`` ends it by its pid."""

    def __init__(self, command: list, env: dict, log_path):
        super().__init__(command, log_path, env=env, start_timeout_s=START_TIMEOUT_S,
                         request_timeout_s=REQUEST_TIMEOUT_S)

    def complete(self, path: str, body: dict) -> dict:
        status, raw = self.post(path, body)
        assert status == 200, raw
        return json.loads(raw)

    def stream(self, path: str, body: dict) -> list[dict]:
        status, raw = self.post(path, {**body, "stream": True})
        assert status == 200, raw
        events = [line[len("data: "):] for line in raw.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return [json.loads(e) for e in events[:-1]]

@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return command_env(tmp_path_factory.mktemp("home"))


@pytest.fixture(scope="module")
def server(tmp_path_factory, env):
    s = Server([*MLX_KNORM, "server", "--model", MODEL_DIR, "--budget", BUDGET], env,
               tmp_path_factory.mktemp("logs") / "mlx-knorm-server.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def stock_server(tmp_path_factory, env):
    s = Server([*MLX_LM, "server", "--model", MODEL_DIR], env,
               tmp_path_factory.mktemp("logs") / "mlx-lm-server.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def expected():
    """What mlx_lm.generate answers to PROMPT (a full KVCache), greedy."""
    model, tokenizer = load(str(MODEL_DIR))
    return generate(model, tokenizer, PROMPT, max_tokens=40)


def text_of(response: dict) -> str:
    choice = response["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def test_models_lists_the_served_model(server):
    status, body = server.get("/v1/models")
    assert status == 200 and str(MODEL_DIR) in [m["id"] for m in body["data"]]


def test_completions_within_the_budget_are_mlx_lm_generate_s(server, expected):
    response = server.complete("/v1/completions", {"prompt": PROMPT, "max_tokens": 40})
    assert text_of(response) == expected
    assert response["usage"]["completion_tokens"] == 40
    events = server.stream("/v1/completions", {"prompt": PROMPT, "max_tokens": 40})
    assert "".join(e["choices"][0].get("text", "") for e in events) == expected


def test_chat_completions_streaming_and_not(server):
    body = {"messages": [{"role": "user", "content": "def test_"}], "max_tokens": 20}
    whole = text_of(server.complete("/v1/chat/completions", body))
    events = server.stream("/v1/chat/completions", body)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == whole
    assert whole


def at_once(server, bodies: list[dict]) -> list[str]:
    """The texts of ``bodies`` sent at once, one client thread each (odd ones streaming)."""
    results = [None] * len(bodies)

    def client(i):
        body = bodies[i]
        if i % 2:
            events = server.stream("/v1/completions", body)
            results[i] = "".join(e["choices"][0].get("text", "") for e in events)
        else:
            results[i] = text_of(server.complete("/v1/completions", body))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(REQUEST_TIMEOUT_S)
    return results


def test_several_clients_at_once_get_what_one_gets(server):
    body = {"prompt": PROMPT, "max_tokens": 24}
    alone = text_of(server.complete("/v1/completions", body))
    assert at_once(server, [body] * 6) == [alone] * 6


BAD_REQUESTS = {
    "invalid JSON": ("/v1/completions", b'{"prompt": "x", '),
    "unknown model": ("/v1/completions", {"prompt": "x", "max_tokens": 4, "model": "no-such/model"}),
    "negative max_tokens": ("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}),
    "not a JSON object": ("/v1/completions", b"[1, 2]"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_requests_get_mlx_lm_s_answer_and_the_server_keeps_serving(case, server, stock_server, expected):
    path, body = BAD_REQUESTS[case]
    ours, theirs = server.post(path, body), stock_server.post(path, body)
    assert ours[0] == theirs[0] >= 400
    assert json.loads(ours[1]) == json.loads(theirs[1])
    assert text_of(server.complete("/v1/completions", {"prompt": PROMPT, "max_tokens": 40})) == expected


# Requests that stock mlx_lm.server cannot take (its generation thread, or
# the whole process, dies of them): ours answers each and keeps serving.
HOSTILE_REQUESTS = {
    "an empty prompt": ({"prompt": ""}, 400, "prompt must be a non-empty string"),
    "a prompt of token lists": ({"prompt": ["import os"]}, 400, "prompt must be a non-empty string"),
    "a stop word that is a number": ({"prompt": PROMPT, "stop": [1]}, 400, "stop must be a string or a list"),
    "a negative logit bias token": ({"prompt": PROMPT, "logit_bias": {"-1": 2}}, 400, "in [0, 2**31)"),
    # Only the generation thread knows the model: mlx-lm answers its errors with 404.
    "a logit bias token past the vocabulary": ({"prompt": PROMPT, "logit_bias": {"99999": 2}}, 404,
                                              "logit_bias token 99999 is outside the model's 256 tokens"),
    "more draft tokens than a verify block holds exactly": ({"prompt": PROMPT, "num_draft_tokens": 16}, 400,
                                                            "num_draft_tokens must be at most 15"),
}


def assert_serving(server, expected) -> None:
    assert server.get("/health") == (200, {"status": "ok"})
    assert text_of(server.complete("/v1/completions", {"prompt": PROMPT, "max_tokens": 40})) == expected


@pytest.mark.parametrize("case", list(HOSTILE_REQUESTS))
def test_requests_stock_mlx_lm_dies_of_are_answered_and_the_server_keeps_serving(case, server, expected):
    body, status, why = HOSTILE_REQUESTS[case]
    for stream in (False, True):
        answer = server.post("/v1/completions", {**body, "max_tokens": 4, "stream": stream})
        assert answer[0] == status and why in json.loads(answer[1])["error"], answer
        assert_serving(server, expected)


def test_the_generation_thread_refuses_what_the_text_does_not_show():
    """A chat template or tokenizer giving no tokens, a logit bias past the
    vocabulary: refused for that request (mlx-lm's thread reports it to the
    request alone) before any of it reaches the batch."""
    from types import SimpleNamespace

    from mlx_knorm.commands.server import check_prompt_tokens

    model, tokenizer = SimpleNamespace(args=SimpleNamespace(vocab_size=300)), [None] * 256
    args = lambda bias: SimpleNamespace(logits=SimpleNamespace(logit_bias=bias))
    with pytest.raises(ValueError, match="the prompt holds no tokens"):
        check_prompt_tokens([], args(None), model, tokenizer)
    with pytest.raises(ValueError, match="logit_bias token 256 is outside the model's 256 tokens"):
        check_prompt_tokens([1], args({3: 1.0, 256: 1.0}), model, tokenizer)
    check_prompt_tokens([1], args({255: 1.0}), model, tokenizer)


def test_a_closed_connection_is_told_from_an_open_one():
    from mlx_knorm.commands.server import client_gone

    ours, theirs = socket.socketpair()
    with ours:
        assert not client_gone(ours)
        theirs.sendall(b"GET / HTTP/1.1\r\n")  # a pipelined request is not a goodbye
        assert not client_gone(ours)
        ours.recv(64)
        theirs.close()
        assert client_gone(ours)


def started(server: Server, count: int, deadline_s: float = 60) -> None:
    """Wait until mlx-lm has taken its ``count``-th request (it logs the
    prompt store at the start of each)."""
    deadline = time.monotonic() + deadline_s
    while server.log_text().count("Prompt Cache:") < count:
        assert time.monotonic() < deadline, server.log_text()
        time.sleep(0.05)


def abandon(server: Server, body: dict) -> None:
    """Send ``body`` on a raw connection and close it once the server is
    generating (a streamed request: its first token received)."""
    data = json.dumps(body).encode()
    taken = server.log_text().count("Prompt Cache:")
    with socket.create_connection(("127.0.0.1", server.port), timeout=REQUEST_TIMEOUT_S) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                           b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
        if body.get("stream"):
            received = b""
            while b"data: " not in received:
                received += connection.recv(4096)
        else:
            started(server, taken + 1)


GENERATED = re.compile(r"Generation: (\d+) tokens")


def generation_stopped(server: Server, logged_before: int, deadline_s: float = 60) -> int:
    """The tokens generated for the request abandoned after ``logged_before``
    statistics lines, once its generation has stopped and logged them."""
    deadline = time.monotonic() + deadline_s
    while len(GENERATED.findall(server.log_text())) <= logged_before:
        assert time.monotonic() < deadline, "the abandoned request is still generating"
        time.sleep(0.05)
    return int(GENERATED.findall(server.log_text())[logged_before])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("fields", [{}, {"skip_layers": [0]}], ids=["batched", "alone"])
def test_a_request_whose_client_is_gone_stops_generating(server, expected, stream, fields):
    """A client that closes its connection stops its request's generation
    within a few tokens, streamed or not, batched or served alone (stock
    mlx_lm.server decodes a non-streamed request to max_tokens)."""
    most = 100_000
    before = len(GENERATED.findall(server.log_text()))
    abandon(server, {"prompt": PROMPT, "max_tokens": most, "stream": stream, **fields})
    assert generation_stopped(server, before) < most
    assert "the client closed its connection; its request is stopped" in server.log_text()
    assert_serving(server, expected)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the server's RSS from /proc")
def test_memory_stays_flat_through_hostile_requests(tmp_path_factory, env, expected):
    """Ten rounds of ten requests (answers whole and streamed, every hostile
    request above, invalid JSON, two abandoned requests) after three rounds
    to warm up: the server answers each and its resident memory stays
    flat (a fixed allowance; measured: well under 1 MB)."""
    s = Server([*MLX_KNORM, "server", "--model", MODEL_DIR, "--budget", BUDGET], env,
               tmp_path_factory.mktemp("logs") / "rss-server.log")
    try:
        def one_round(k: int) -> None:
            prompt = f"# {k}\n" + PROMPT  # a new conversation for the store each time
            s.complete("/v1/completions", {"prompt": prompt, "max_tokens": 16})
            s.stream("/v1/completions", {"prompt": prompt + LONG_PROMPT, "max_tokens": 16})
            for body, status, _ in HOSTILE_REQUESTS.values():
                assert s.post("/v1/completions", {**body, "max_tokens": 4})[0] == status
            assert s.post("/v1/completions", b'{"prompt": ')[0] == 400
            for stream in (False, True):
                before = len(GENERATED.findall(s.log_text()))
                abandon(s, {"prompt": prompt, "max_tokens": 100_000, "stream": stream})
                generation_stopped(s, before)

        for k in range(3):
            one_round(k)
        warm = s.rss()
        for k in range(3, 13):
            one_round(k)
        grown = s.rss() - warm
        assert_serving(s, expected)
    finally:
        s.stop()
    assert grown < RSS_ALLOWANCE, f"RSS grew by {grown} bytes over 100 requests"


# What the server's resident memory may grow by over 100 requests once warm.
RSS_ALLOWANCE = 8 << 20


@pytest.mark.parametrize("fields, why", [
    ({"budget": 4}, "n_sink (4) + recent (0) must be < budget (4)"),
    ({"budget": 16, "n_sink": 8, "recent": 8}, "n_sink (8) + recent (8) must be < budget (16)"),
    ({"budget": "64"}, "budget must be an int"),
    ({"keep": "middle"}, "keep must be 'low' or 'high'"),
    ({"skip_layers": 1}, "skip_layers must be a list"),
    ({"budget": 32, "max_kv_size": 48}, "are one setting"),
])
def test_bad_cache_fields_get_400_as_bad_parameters_do(fields, why, server, expected):
    status, raw = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, **fields})
    assert status == 400 and why in json.loads(raw)["error"]
    assert text_of(server.complete("/v1/completions", {"prompt": PROMPT, "max_tokens": 40})) == expected


def test_a_skip_layer_the_model_lacks_is_an_error_and_the_server_keeps_serving(server, expected):
    status, raw = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "skip_layers": [9]})
    assert status == 404 and "out of range for a model with 4 layers" in json.loads(raw)["error"]
    assert text_of(server.complete("/v1/completions", {"prompt": PROMPT, "max_tokens": 40})) == expected


def test_a_follow_up_reuses_the_conversation_s_cache_with_the_same_settings(server):
    first = server.complete("/v1/completions", {"prompt": "class Test", "max_tokens": 16})
    follow_up = "class Test" + text_of(first) + "\n    def "
    again = server.complete("/v1/completions", {"prompt": follow_up, "max_tokens": 8})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len("class Test") + 16
    other = server.complete("/v1/completions", {"prompt": follow_up, "max_tokens": 8, "budget": 48})
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.parametrize("fields", [{}, {"skip_layers": [0]}], ids=["batched", "alone"])
def test_a_prompt_equal_to_a_stored_conversation_reuses_all_but_its_last_token(server, fields):
    """Past the budget, a batched request's stored caches (extract()ed)
    cannot trim, so a prompt equal to a stored key takes the cache stored
    under the prompt without its last token, looked up under the server's
    settings once; a cache served alone trims its last token."""
    prompt = LONG_PROMPT + f"def run_{len(fields)}(path):\n    return os.path."
    # Stored: the prompt and one answer token, then the prompt and two.
    answers = [text_of(server.complete("/v1/completions", {"prompt": prompt, "max_tokens": n, **fields}))
               for n in (1, 2)]
    assert answers[0] == answers[1][:1] and len(answers[1]) == 2  # letters: one token each
    again = server.complete("/v1/completions", {"prompt": prompt + answers[1], "max_tokens": 4, **fields})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) + 1


def test_past_the_budget_a_request_goes_on_and_memory_stays_at_the_budget(server):
    before = len(kv_lines(server.log_text()))
    for prompt in (LONG_PROMPT, LONG_PROMPT * 2):
        response = server.complete("/v1/completions", {"prompt": prompt, "max_tokens": 30})
        assert response["usage"]["completion_tokens"] == 30
    # Each request's line, by its token count (an earlier test's request may log after `before`).
    tokens = (len(LONG_PROMPT) + 30, 2 * len(LONG_PROMPT) + 30)
    deadline = time.monotonic() + 10
    while True:
        lines = {line["tokens"]: line for line in kv_lines(server.log_text())[before:]}
        if all(t in lines for t in tokens) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    first, second = (lines[t] for t in tokens)
    assert first["held_mb"] == second["held_mb"] < first["full_mb"] < second["full_mb"]
    assert evicting(first, BUDGET)
    assert "Peak memory:" in server.log_text()


@pytest.fixture(scope="module")
def shipped():
    return load(str(MODEL_DIR))


def test_a_prompt_that_leaves_a_cached_conversation_gets_a_fresh_cache_s_answer(server, shipped):
    """Past the budget, a cached conversation cannot be trimmed back to a
    shorter prompt (mlx-lm's own LRUPromptCache would trim it anyway, and
    answer from rows of tokens the prompt does not hold); within it, it is
    trimmed exactly, as mlx-lm trims a KVCache."""
    from mlx_knorm.cache import make_knorm_cache

    model, tokenizer = shipped
    for cached, asked in [
        (LONG_PROMPT, LONG_PROMPT[: len(LONG_PROMPT) // 2] + "def other():\n    "),
        ("class Alphabet", "class Alpha_two"),
    ]:
        server.complete("/v1/completions", {"prompt": cached, "max_tokens": 8})
        answer = server.complete("/v1/completions", {"prompt": asked, "max_tokens": 24})
        fresh = generate(model, tokenizer, asked, max_tokens=24,
                         prompt_cache=make_knorm_cache(model, budget=BUDGET))
        assert text_of(answer) == fresh
        reused = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert reused == (0 if len(cached) > BUDGET else len("class Alpha"))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A 2-layer tiny random llama (a draft sharing the shipped model's
    tokenizer), the tiny llama with heads wide enough for --kv-bits, and
    the tiny llama itself (it has a chat template)."""
    where = tmp_path_factory.mktemp("models")
    return {"draft": write_tiny_llama(where / "draft", num_hidden_layers=2),
            "wide": write_tiny_llama(where / "wide", head_dim=WIDE_HEAD_DIM),
            "tiny": write_tiny_llama(where / "tiny")}


@pytest.mark.parametrize("recent", [None, 0])
def test_a_draft_model_s_server_answers_what_decoding_without_one_gives(tmp_path_factory, env, models, shipped,
                                                                        recent):
    """Speculative decoding past the budget, greedy: the tokens of ordinary
    decoding, for a fresh conversation and for its follow-up (which reuses
    the stored target and draft caches), with make_knorm_cache's default
    recent window and without one."""
    from mlx_knorm.cache import make_knorm_cache

    window = [] if recent is None else ["--recent", recent]
    s = Server([*MLX_KNORM, "server", "--model", MODEL_DIR, "--budget", 48, *window,
                "--draft-model", models["draft"], "--num-draft-tokens", 3], env,
               tmp_path_factory.mktemp("logs") / "draft-server.log")
    try:
        model, tokenizer = shipped
        first = text_of(s.complete("/v1/completions", {"prompt": PROMPT, "max_tokens": 60}))
        cache = make_knorm_cache(model, budget=48, recent=recent)
        assert first == generate(model, tokenizer, PROMPT, max_tokens=60, prompt_cache=cache)
        follow_up = PROMPT + first + "\n\ndef other(path):\n    return os.path."
        again = s.complete("/v1/completions", {"prompt": follow_up, "max_tokens": 40})
        reused = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        # The stored caches hold the conversation but for the answer's last
        # token where that is the target's own, not a draft's (speculative
        # decoding does not feed it): the store keys them by what they hold,
        # and the follow-up feeds that token again.
        unfed = cache[0].offset - reused
        assert unfed in (0, 1) and reused > len(PROMPT)
        assert trim_prompt_cache(cache, unfed) == unfed
        # Without a draft, on the same path: the conversation's cache, then
        # the follow-up's tokens past it (a fresh cache for the whole
        # follow-up would hold other rows past the budget: its prompt is one
        # block, the conversation's answer was decoded token by token).
        rest = mx.array(tokenizer.encode(follow_up)[reused:])
        plain = generate(model, tokenizer, rest, max_tokens=40, prompt_cache=cache)
        assert text_of(again) == plain and plain.strip()
    finally:
        s.stop()


def test_a_server_refuses_more_draft_tokens_than_a_verify_block_holds_exactly(env):
    """--num-draft-tokens is each request's default (a request may name a
    draft model): past MAX_DRAFT_TOKENS the server does not start."""
    from mlx_knorm.cache import MAX_DRAFT_TOKENS

    refused = run([*MLX_KNORM, "server", "--model", MODEL_DIR, "--num-draft-tokens", MAX_DRAFT_TOKENS + 1,
                   "--port", free_port()], env)
    assert refused.returncode == 2 and f"--num-draft-tokens must be at most {MAX_DRAFT_TOKENS}" in refused.stderr


def test_kv_bits_on_the_server_keeps_budget_quantized_rows(tmp_path_factory, env, models):
    from mlx_lm.sample_utils import make_sampler

    from mlx_knorm.cache import make_knorm_cache

    s = Server([*MLX_KNORM, "server", "--model", models["wide"], "--budget", 48, "--kv-bits", 4,
                "--kv-group-size", 32, "--quantized-kv-start", 0], env,
               tmp_path_factory.mktemp("logs") / "kv-bits-server.log")
    try:
        body = {"prompt": LONG_PROMPT[:200], "max_tokens": 40, "temperature": 0.8, "top_p": 0.9, "seed": 3}
        answer = text_of(s.complete("/v1/completions", body))
        deadline = time.monotonic() + 10
        while not kv_lines(s.log_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        [line] = kv_lines(s.log_text())
    finally:
        s.stop()
    assert evicting(line, 48) and line["tokens"] > 48
    assert line["allocated_mb"] == mb(tiny_kv_bytes(48, WIDE_HEAD_DIM, bits=4, group_size=32)) < line["full_mb"]
    model, tokenizer = load(str(models["wide"]))
    mx.random.seed(3)
    assert answer == generate(model, tokenizer, LONG_PROMPT[:200], max_tokens=40,
                              sampler=make_sampler(0.8, 0.9), prompt_cache=make_knorm_cache(model, budget=48),
                              kv_bits=4, kv_group_size=32, quantized_kv_start=0)


STORE_LINE = re.compile(r"mlx-knorm: prompt cache: (\d+) sequences, (\d+) bytes")


def store_after(server: Server, count: int) -> tuple[int, int]:
    """What the server's prompt store holds after its ``count``-th stored
    request (its log line: sequences, bytes)."""
    deadline = time.monotonic() + 10
    while len(STORE_LINE.findall(server.log_text())) < count and time.monotonic() < deadline:
        time.sleep(0.1)
    lines = STORE_LINE.findall(server.log_text())
    assert len(lines) == count, server.log_text()
    return tuple(map(int, lines[-1]))


def test_the_prompt_store_holds_one_cache_a_conversation(tmp_path_factory, env, models):
    """mlx-lm's batch loop also stores each request's cache after all of its
    prompt but the last token; past the budget the finished cache cannot be
    trimmed back to it, so mlx-lm's store would keep both, twice the bytes a
    conversation. The server drops that checkpoint once the request's cache
    is stored: one cache of at most the budget's slots a conversation, as
    when it is served alone; a follow-up continues it, and a chat's system
    prompt checkpoint stays for the next chat with that system prompt."""
    budget = 48
    s = Server([*MLX_KNORM, "server", "--model", models["tiny"], "--budget", budget], env,
               tmp_path_factory.mktemp("logs") / "store-server.log")
    try:
        prompts = [f"# part {i}\n" + LONG_PROMPT for i in range(3)]  # none a prefix of another
        for i, prompt in enumerate(prompts):
            answer = text_of(s.complete("/v1/completions", {"prompt": prompt, "max_tokens": 8}))
            # mlx-lm's count of what its store held at the request's start.
            assert re.findall(r"Prompt Cache: (\d+) sequences", s.log_text())[-1] == str(i)
        assert "mlx-knorm: batching 1 requests" in s.log_text(), "the requests were not batched"
        store_after(s, len(prompts))
        for i, (sequences, held) in enumerate(STORE_LINE.findall(s.log_text()), 1):
            assert int(sequences) == i and int(held) <= i * tiny_kv_bytes(budget), (sequences, held)
        # A follow-up continues the conversation.
        follow_up = prompts[-1] + answer + "\n\ndef main():\n"
        again = s.complete("/v1/completions", {"prompt": follow_up, "max_tokens": 8})
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompts[-1]) + 8
        assert store_after(s, 4)[0] == 4
        # A chat with a system prompt: its checkpoint and the chat's cache.
        system = {"role": "system", "content": "You answer in Python."}
        chat = {"messages": [system, {"role": "user", "content": LONG_PROMPT}], "max_tokens": 8}
        s.complete("/v1/chat/completions", chat)
        assert store_after(s, 5)[0] == 6
        other = {"messages": [system, {"role": "user", "content": "# other\n" + LONG_PROMPT}], "max_tokens": 8}
        reused = s.complete("/v1/chat/completions", other)["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert reused == len(f"<system>{system['content']}\n<user>")
    finally:
        s.stop()

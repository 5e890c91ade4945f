"""``mlx-knorm server`` under hostile use, round two: a qfilter request for a
model the server holds no filters of gets 400, a body that is not UTF-8
gets 400 (stock mlx-lm closes the connection), and requests that each set
other cache values leave nothing behind: the prompt store and the memo of
batchable settings stay bounded, and so does the process's memory through
a bounded loop against a real server (bench/server_memory.py, shortened)."""

from __future__ import annotations

import json
import runpy
import socket
import sys
from pathlib import Path

import numpy as np
import pytest

from command_runs import MLX_KNORM, command_env
from mlx_knorm.commands.loading import install_cache
from mlx_knorm.commands.server import BATCHABLE_MEMO_SIZE, ServerSession, check_qfilter_request
from mlx_knorm.commands.session import CacheConfig
from mlx_knorm.lru import LRUPromptCache
from mlx_knorm.quality import MODEL_DIR
from mlx_knorm.scorers import QueryFilters, model_attention_layers
from test_command_server import PROMPT, Server
from tiny_models import tiny_model, tokens

BENCH = Path(__file__).resolve().parents[1] / "bench"


# -- bounded by construction ---------------------------------------------------


def test_the_prompt_store_forgets_the_keys_of_settings_it_no_longer_holds():
    """The server keys its store by model and cache settings: 100 settings
    through a store of 3 leave 3 keys in its trie, not 100."""
    model = tiny_model("llama", layers=2)
    store = LRUPromptCache(max_size=3)
    for budget in range(8, 108):
        cache = CacheConfig(budget=budget).make_cache(model)
        model(tokens(1, 3), cache=cache)
        store.insert_cache(("m", CacheConfig(budget=budget)), [1, 2, 3], cache)
    assert len(store) == 3 and len(store._trie._trie) == 3
    assert store.fetch_nearest_cache(("m", CacheConfig(budget=107)), [1, 2, 3])[0] is not None
    assert store.fetch_nearest_cache(("m", CacheConfig(budget=8)), [1, 2, 3]) == (None, [1, 2, 3])
    store.trim_to(n_sequences=0)
    assert len(store._trie._trie) == 0


def test_the_memo_of_batchable_settings_is_bounded():
    model = tiny_model("llama", layers=2)
    session = ServerSession()
    install_cache(model, session.make_cache)
    for budget in range(8, 8 + 3 * BATCHABLE_MEMO_SIZE):
        assert session.batchable(CacheConfig(budget=budget), model)
    assert len(session._batchable) == BATCHABLE_MEMO_SIZE
    assert not session.batchable(CacheConfig(budget=8, skip_layers=(0,)), model)
    assert len(session._batchable) == BATCHABLE_MEMO_SIZE


def test_a_qfilter_request_needs_filters_of_the_model_it_names():
    filters = CacheConfig(scorer="qfilter", filters=QueryFilters({0: np.eye(2, 4, dtype=np.float32)}))
    for requested in ("default_model", "served/model"):
        check_qfilter_request(filters, requested, "served/model")
    with pytest.raises(ValueError, match="query filters are its --model served/model's, not model other/model's"):
        check_qfilter_request(filters, "other/model", "served/model")
    with pytest.raises(ValueError, match="has none of"):
        check_qfilter_request(CacheConfig(scorer="qfilter"), "default_model", "served/model")


# -- a real server -------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The shipped model served with query filters of its shape."""
    from mlx_knorm.quality.cli import load

    folder = tmp_path_factory.mktemp("hostile-server")
    model = load(None)[0]
    n_layers, layers = model_attention_layers(model)
    heads, dim = model.args.num_key_value_heads, model.args.hidden_size // model.args.num_attention_heads
    rows = np.eye(heads, dim, dtype=np.float32)
    path = QueryFilters({i: rows for i in layers}, {"layers": n_layers}).save(folder / "filters.safetensors")
    s = Server([*MLX_KNORM, "server", "--model", MODEL_DIR, "--budget", 32, "--filters", path],
               command_env(folder / "home"), folder / "server.log")
    yield s
    s.stop()


def test_a_qfilter_request_for_another_model_gets_400(server):
    body = {"prompt": PROMPT, "max_tokens": 4, "scorer": "qfilter"}
    status, raw = server.post("/v1/completions", {**body, "model": "mlx-community/another-model"})
    assert status == 400 and "not model mlx-community/another-model's" in json.loads(raw)["error"]
    assert server.post("/v1/completions", body)[0] == 200
    assert server.post("/v1/completions", {**body, "model": str(MODEL_DIR)})[0] == 200


def raw_post(server, body: bytes, length: str | None = None) -> bytes:
    """``body`` POSTed as it is, on a socket of its own; the whole answer."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body) if length is None else length}\r\n\r\n".encode() + body)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    return answer


@pytest.mark.parametrize("body", [b"\xff\xfe{}", b'{"prompt": "\xc3("}', b"\x80"])
def test_a_body_that_is_not_utf8_gets_400_and_the_server_keeps_serving(body, server):
    answer = raw_post(server, body)
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 400") and "not UTF-8" in json.loads(payload)["error"]
    assert raw_post(server, b'{"prompt": "a"').startswith(b"HTTP/1.0 400")  # invalid JSON, as before
    assert raw_post(server, b"{}", length="-1").startswith(b"HTTP/1.0 400")  # not a length
    assert server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4})[0] == 200


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the server's RSS from /proc")
def test_memory_stays_flat_under_requests_that_each_set_other_cache_values(tmp_path):
    """bench/server_memory.py, shortened: after warm-up, requests whose every
    cache field differs from every other's; the store holds at most
    --prompt-cache-size conversations and RSS grows by less than 2 MB
    (the program's exit status; the 2,000-request run is in
    bench/results/server-memory-cpu.json)."""
    program = runpy.run_path(str(BENCH / "server_memory.py"))
    path = tmp_path / "report.json"
    status = program["main"](["--warm-up", "60", "--requests", "120", "--sample-every", "40",
                              "--prompt-cache-size", "4", "--deadline-s", "240", "--json", str(path)])
    report = json.loads(path.read_text())
    assert report["statuses"] == {"200": 180} and report["requests_after_warm_up"] == 120
    assert report["prompt_store_sequences_max"] == 4
    assert status == 0, report["samples"]

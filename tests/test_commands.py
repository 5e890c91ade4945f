"""``mlx-knorm generate | chat | cache-prompt`` run as a user runs them: as
subprocesses, on the shipped model and a tiny random-weight llama, next to
mlx-lm's own commands with the same flags."""

from __future__ import annotations

import contextlib
import io
import re
import sys

import mlx.core as mx
import pytest

from command_runs import (
    MLX_KNORM,
    MLX_LM,
    TINY_HEAD_DIM,
    TINY_KV_HEADS,
    WIDE_HEAD_DIM,
    command_env,
    evicting,
    kv_lines,
    mb,
    mlx_lm_stat,
    run,
    succeeded,
    tiny_kv_bytes,
    write_tiny_llama,
)
from mlx_knorm.__main__ import main as mlx_knorm_main
from mlx_knorm.cache import MAX_DRAFT_TOKENS
from mlx_knorm.commands.session import SKIP_LAYERS_WITH_DRAFT
from mlx_knorm.quality import MODEL_DIR

SHIPPED_PROMPT = "import os\nimport sys\n\n\ndef main():\n    "
# Sampling flags passed to both commands: they must reach mlx-lm's sampler alike.
SAMPLING = ["--temp", "0.8", "--top-p", "0.9", "--seed", "3"]
DOCUMENT = '"""Helpers for reading configuration files."""\n\nimport os\nimport sys\n\n\n' * 12


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return command_env(tmp_path_factory.mktemp("home"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("models") / "wide-llama", head_dim=WIDE_HEAD_DIM)


def mlx_lm_flags(command: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", _help(lambda: _mlx_lm_main(command))))


def _mlx_lm_main(command: str) -> None:
    import importlib

    module = importlib.import_module(f"mlx_lm.{command.replace('-', '_')}")
    argv = sys.argv
    sys.argv = [f"mlx_lm.{command}", "--help"]
    try:
        module.main()
    finally:
        sys.argv = argv


def _help(call) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stop:
        call()
    assert stop.value.code == 0
    return out.getvalue()


@pytest.mark.parametrize("command", ["generate", "chat", "cache-prompt", "server"])
def test_help_lists_every_mlx_lm_flag_and_the_cache_flags(command):
    text = _help(lambda: mlx_knorm_main([command, "--help"]))
    ours = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))
    assert mlx_lm_flags(command) <= ours
    assert {"--budget", "--max-kv-size", "--n-sink", "--recent", "--keep", "--skip-layers", "--layout"} <= ours
    assert text.startswith(f"usage: mlx-knorm {command}")
    if command == "server":
        assert "Concurrent requests with the same cache settings are batched" in text
        # Every field a request may set is named in the help, scorer among them.
        from mlx_knorm.commands.session import CACHE_FIELDS
        assert all(f'"{field}"' in " ".join(text.split()) for field in (*CACHE_FIELDS, "max_kv_size"))


@pytest.mark.parametrize("model, prompt, flags", [
    ("shipped", SHIPPED_PROMPT, []),
    ("tiny", "hello there", []),
    ("tiny", "hello there", SAMPLING),
])
def test_generate_within_the_budget_prints_what_mlx_lm_generate_prints(model, prompt, flags, tiny, env):
    path = MODEL_DIR if model == "shipped" else tiny
    args = ["--model", path, "--prompt", prompt, "--max-tokens", "60", *flags]
    ours = succeeded(run([*MLX_KNORM, "generate", *args, "--budget", "512", "--verbose", "F"], env))
    theirs = succeeded(run([*MLX_LM, "generate", *args, "--verbose", "F"], env))
    assert ours.stdout == theirs.stdout
    assert len(ours.stdout.strip()) > 0


def test_generate_past_the_budget_goes_on_and_memory_stays_at_the_budget(tiny, env):
    budget, runs = 48, []
    for max_tokens in (60, 120):
        out = succeeded(run([*MLX_KNORM, "generate", "--model", tiny, "--prompt", "hello there",
                             "--max-tokens", max_tokens, "--max-kv-size", budget], env)).stdout
        assert mlx_lm_stat(out, "Generation") == max_tokens
        assert "Peak memory:" in out
        [line] = kv_lines(out)
        assert line["tokens"] == mlx_lm_stat(out, "Prompt") + max_tokens > budget
        assert line["kinds"] == f"eviction (budget {budget}) in layers 0-3"
        runs.append(line)
    first, second = runs
    # The budget's rows and the newest in every layer, in the slots allocated.
    assert first["held_mb"] == second["held_mb"] == first["allocated_mb"] == mb(tiny_kv_bytes(budget))
    assert second["full_mb"] > first["full_mb"] > first["held_mb"]


def test_skip_layers_keep_every_token_in_those_layers(tiny, env):
    out = succeeded(run([*MLX_KNORM, "generate", "--model", tiny, "--prompt", "hello there",
                         "--max-tokens", "120", "--budget", "48", "--skip-layers", "0,1"], env)).stdout
    [line] = kv_lines(out)
    # Two evicting layers at the budget; two KVCaches of 256-slot steps.
    per_layer = tiny_kv_bytes(48) / 4
    kv_cache_row = TINY_KV_HEADS * TINY_HEAD_DIM * 2 * 2
    kv_cache_layer = 256 * -(-line["tokens"] // 256) * kv_cache_row
    assert line["allocated_mb"] == mb(2 * per_layer + 2 * kv_cache_layer)
    assert line["held_mb"] == mb(2 * per_layer + 2 * line["tokens"] * kv_cache_row)
    assert line["kinds"].startswith("eviction (budget 48) in layers 2-3: ")
    assert "; no eviction in 2 layers: " in line["kinds"]


@pytest.mark.parametrize("command", ["generate", "chat", "cache-prompt", "server"])
@pytest.mark.parametrize("flags, why", [
    (["--budget", "4"], "n_sink (4) + recent (0) must be < budget (4)"),
    (["--budget", "64", "--max-kv-size", "32"], "are one setting"),
    (["--n-sink", "-1"], "n_sink must be >= 0"),
    (["--skip-layers", "0,x"], "expected comma-separated layer indices"),
    (["--keep", "middle"], "invalid choice: 'middle'"),
])
def test_bad_cache_flags_stop_the_command_before_it_loads_anything(command, flags, why, capsys):
    with pytest.raises(SystemExit) as stop:
        mlx_knorm_main([command, "--model", "no/such-model", "--prompt", "x",
                        "--prompt-cache-file", "x.safetensors", *flags]
                       if command == "cache-prompt" else [command, "--model", "no/such-model", *flags])
    assert stop.value.code == 2
    assert why in capsys.readouterr().err


def test_kv_bits_within_the_budget_prints_what_mlx_lm_generate_prints(wide, env):
    # float16 rows quantized as mlx-lm quantizes them: the same logits, so
    # the same samples (a random-weight model's greedy text is one token).
    args = ["--model", wide, "--prompt", "hello there", "--max-tokens", "60", *SAMPLING, "--verbose", "F"]
    quantized = ["--kv-bits", "4", "--quantized-kv-start", "0"]
    ours = succeeded(run([*MLX_KNORM, "generate", *args, *quantized, "--budget", "512"], env))
    theirs = succeeded(run([*MLX_LM, "generate", *args, *quantized], env))
    assert ours.stdout == theirs.stdout and ours.stdout.strip()
    float_rows = succeeded(run([*MLX_KNORM, "generate", *args, "--budget", "512"], env))
    assert float_rows.stdout != ours.stdout  # the quantization shows


def test_kv_bits_past_the_budget_keeps_budget_quantized_rows(wide, env):
    out = succeeded(run([*MLX_KNORM, "generate", "--model", wide, "--prompt", "hello there",
                         "--max-tokens", "120", "--budget", "48", "--kv-bits", "4", "--kv-group-size", "32",
                         "--quantized-kv-start", "0"], env)).stdout
    assert mlx_lm_stat(out, "Generation") == 120
    [line] = kv_lines(out)
    assert line["kinds"] == "eviction (budget 48, 4-bit rows) in layers 0-3" and line["tokens"] > 48
    held = mb(tiny_kv_bytes(48, WIDE_HEAD_DIM, bits=4, group_size=32))
    assert line["held_mb"] == line["allocated_mb"] == held < line["full_mb"]
    assert held < tiny_kv_bytes(48, WIDE_HEAD_DIM) / 1e6 * 0.35


def test_a_draft_model_gives_the_tokens_of_ordinary_decoding(tiny, env):
    """Greedy speculative decoding (the shipped model drafted by the tiny
    random llama, which shares its tokenizer: many rejected drafts) past the
    budget gives what decoding without a draft gives, in both layouts."""
    for layout in ("slots", "temporal"):
        args = ["--model", MODEL_DIR, "--prompt", SHIPPED_PROMPT, "--max-tokens", "100", "--budget", "48",
                "--layout", layout, "--verbose", "F"]
        plain = succeeded(run([*MLX_KNORM, "generate", *args], env)).stdout
        drafted = succeeded(run([*MLX_KNORM, "generate", *args, "--draft-model", tiny,
                                 "--num-draft-tokens", "3"], env)).stdout
        assert drafted == plain and len(plain) > 90


def test_draft_tokens_past_an_exact_verify_block_are_refused(env):
    """A verify block of MAX_DRAFT_TOKENS + 1 = EXACT_BLOCK tokens still
    attends as single steps would (docs/spec.md §8: the model drafting for
    itself, every draft accepted, every block evicting inside); one more
    draft token would not (its output differs), so the command refuses it."""
    args = ["--model", MODEL_DIR, "--prompt", SHIPPED_PROMPT, "--max-tokens", "200", "--budget", "48",
            "--verbose", "F", "--draft-model", MODEL_DIR]
    plain = succeeded(run([*MLX_KNORM, "generate", *args[:-2]], env)).stdout
    most = succeeded(run([*MLX_KNORM, "generate", *args, "--num-draft-tokens", str(MAX_DRAFT_TOKENS)], env))
    assert most.stdout == plain
    refused = run([*MLX_KNORM, "generate", *args, "--num-draft-tokens", str(MAX_DRAFT_TOKENS + 1)], env)
    assert refused.returncode == 2 and not refused.stdout
    assert f"--num-draft-tokens must be at most {MAX_DRAFT_TOKENS}" in refused.stderr


def test_a_model_drafting_for_itself_is_the_target_once_and_the_draft_once(env):
    # Both loads come from one path: the first is the target (its cache is
    # the one reported), the second the draft, which every draft agrees with.
    args = ["--model", MODEL_DIR, "--prompt", SHIPPED_PROMPT, "--max-tokens", "60", "--budget", "32"]
    plain = succeeded(run([*MLX_KNORM, "generate", *args], env)).stdout
    drafted = succeeded(run([*MLX_KNORM, "generate", *args, "--draft-model", MODEL_DIR], env)).stdout
    text = lambda out: out.split("==========")[1]
    assert text(drafted) == text(plain) and len(text(plain)) > 50
    # The target's cache (mlx-lm's speculative loop leaves its last token unfed).
    [line] = kv_lines(drafted)
    [plain_line] = kv_lines(plain)
    assert evicting(line, 32) and line["tokens"] == plain_line["tokens"] - 1 and line["held_mb"] > 0


def test_skip_layers_are_the_target_s_not_the_draft_s(tmp_path, env):
    # Layer 3 of the 4-layer target; the 2-layer draft's cache evicts in every layer.
    draft = write_tiny_llama(tmp_path / "draft", num_hidden_layers=2)
    result = succeeded(run([*MLX_KNORM, "generate", "--model", MODEL_DIR, "--prompt", SHIPPED_PROMPT,
                            "--max-tokens", "60", "--budget", "32", "--skip-layers", "3",
                            "--draft-model", draft], env))
    assert mlx_lm_stat(result.stdout, "Generation") == 60
    # Not linked, the target's verify blocks attend as blocks: the command says so.
    assert SKIP_LAYERS_WITH_DRAFT in result.stderr.replace("\n", " ")


@pytest.fixture(scope="module")
def prompt_caches(tmp_path_factory, env):
    """The document cached by ``mlx-knorm cache-prompt`` (budget 64 and a budget it
    fits in) and by ``mlx_lm.cache_prompt``, on the shipped model."""
    where = tmp_path_factory.mktemp("prompt-caches")
    files = {name: where / f"{name}.safetensors" for name in ("budget64", "budget4096", "mlx_lm")}
    common = ["--model", MODEL_DIR, "--prompt", DOCUMENT]
    out = succeeded(run([*MLX_KNORM, "cache-prompt", *common, "--budget", "64",
                         "--prompt-cache-file", files["budget64"]], env)).stdout
    succeeded(run([*MLX_KNORM, "cache-prompt", *common, "--budget", "4096",
                   "--prompt-cache-file", files["budget4096"]], env))
    succeeded(run([*MLX_LM, "cache_prompt", *common, "--prompt-cache-file", files["mlx_lm"]], env))
    return files, out


def test_cache_prompt_writes_mlx_lm_s_file_with_budget_rows(prompt_caches):
    files, out = prompt_caches
    ours, ours_meta = mx.load(str(files["budget64"]), return_metadata=True)
    theirs, theirs_meta = mx.load(str(files["mlx_lm"]), return_metadata=True)
    for key in ("0.model", "0.tokenizer_config"):
        assert ours_meta[key] == theirs_meta[key]
    layers = [v for k, v in ours_meta.items() if k.startswith("1.")]
    assert layers == ["L2NormKVCache"] * 4
    # Per layer: keys and values [1, 2 heads, 64 rows, 16], norms and positions [1, 2, 64].
    for layer in range(4):
        assert ours[f"{layer}.0"].shape == ours[f"{layer}.1"].shape == (1, 2, 64, 16)
        assert ours[f"{layer}.2"].shape == ours[f"{layer}.3"].shape == (1, 2, 64)
    [line] = kv_lines(out)
    assert line["tokens"] == len(DOCUMENT) and evicting(line, 64)
    assert "Peak memory:" in out


def test_generate_answers_from_a_prompt_cache_as_mlx_lm_does(prompt_caches, env):
    files, _ = prompt_caches
    args = ["--prompt", "def ", "--max-tokens", "40", "--verbose", "F"]
    ours = succeeded(run([*MLX_KNORM, "generate", "--prompt-cache-file", files["budget4096"], *args], env))
    theirs = succeeded(run([*MLX_LM, "generate", "--prompt-cache-file", files["mlx_lm"], *args], env))
    assert ours.stdout == theirs.stdout and ours.stdout.strip()
    # mlx_lm.cache_prompt's file (KVCache layers) is used as mlx-lm uses it.
    stock = succeeded(run([*MLX_KNORM, "generate", "--prompt-cache-file", files["mlx_lm"], *args], env))
    assert stock.stdout == theirs.stdout
    # Past the budget: it answers from the 64 rows kept, and memory stays there.
    small = succeeded(run([*MLX_KNORM, "generate", "--prompt-cache-file", files["budget64"],
                           "--prompt", "def ", "--max-tokens", "40"], env)).stdout
    assert mlx_lm_stat(small, "Generation") == 40
    [line] = kv_lines(small)
    assert line["tokens"] == len(DOCUMENT) + 4 + 40 and evicting(line, 64)


def test_a_draft_model_answers_from_a_prompt_cache_what_decoding_without_one_gives(prompt_caches, tiny, env):
    # The file holds the target's layers; the draft starts afresh (mlx-lm's
    # own command fails here: it finds no draft layers in the file).
    files, _ = prompt_caches
    args = ["--prompt-cache-file", files["budget64"], "--prompt", "def ", "--max-tokens", "40"]
    plain = succeeded(run([*MLX_KNORM, "generate", *args], env)).stdout
    drafted = succeeded(run([*MLX_KNORM, "generate", *args, "--draft-model", tiny], env)).stdout
    assert drafted.split("==========")[1] == plain.split("==========")[1]
    [line] = kv_lines(drafted)
    assert evicting(line, 64) and line["tokens"] == kv_lines(plain)[0]["tokens"] - 1


def _tamper(source, target, arrays=None, metadata=None):
    loaded, meta = mx.load(str(source), return_metadata=True)
    loaded.update(arrays(loaded) if arrays else {})
    meta.update(metadata or {})
    mx.save_safetensors(str(target), loaded, meta)
    return target


@pytest.mark.parametrize("case", ["another model", "other model path", "norms", "truncated", "settings"])
def test_generate_refuses_a_prompt_cache_that_does_not_fit(case, prompt_caches, tiny, env, tmp_path):
    files, _ = prompt_caches
    source, target, extra = files["budget64"], tmp_path / "bad.safetensors", []
    if case == "another model":  # the metadata names the tiny llama, the rows are the shipped model's
        bad, expect = _tamper(source, target, metadata={"0.model": str(tiny)}), "layer 0 holds 1 x 2 heads"
    elif case == "other model path":  # mlx-lm's own check
        bad, extra, expect = source, ["--model", tiny], "than that used to create the prompt cache"
    elif case == "norms":
        bad = _tamper(source, target, arrays=lambda a: {"1.2": a["1.2"] * 1.5})
        expect = "field 'norms'"
    elif case == "truncated":
        target.write_bytes(source.read_bytes()[:-100])
        bad, expect = target, "refusing --prompt-cache-file"
    else:
        bad, extra, expect = source, ["--budget", "32"], "keeps the settings it was made with"
    result = run([*MLX_KNORM, "generate", "--prompt-cache-file", bad, "--prompt", "def ", *extra], env)
    assert result.returncode == 1, result.stderr
    assert expect in result.stderr
    assert "==========" not in result.stdout and result.stdout == ""


QUANTIZED = ["--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "0"]
# Past the budget of 64, and short: mlx-lm's quantized attention is slow on this CPU.
QUANTIZED_DOCUMENT = DOCUMENT[:300]


@pytest.fixture(scope="module")
def quantized_caches(tmp_path_factory, wide, env):
    """The document cached with --kv-bits 4 by ``mlx-knorm cache-prompt``
    (budget 64 and a budget it fits in) and by ``mlx_lm.cache_prompt``, on
    the wide tiny llama."""
    where = tmp_path_factory.mktemp("quantized-prompt-caches")
    files = {name: where / f"{name}.safetensors" for name in ("budget64", "budget4096", "mlx_lm")}
    common = ["--model", wide, "--prompt", QUANTIZED_DOCUMENT, *QUANTIZED]
    for budget in (64, 4096):
        succeeded(run([*MLX_KNORM, "cache-prompt", *common, "--budget", budget,
                       "--prompt-cache-file", files[f"budget{budget}"]], env))
    succeeded(run([*MLX_LM, "cache_prompt", *common, "--prompt-cache-file", files["mlx_lm"]], env))
    return files


def test_quantized_prompt_caches_save_load_and_answer_as_mlx_lm_s(quantized_caches, wide, env):
    files = quantized_caches
    arrays, metadata = mx.load(str(files["budget64"]), return_metadata=True)
    assert [v for k, v in metadata.items() if k.startswith("1.")] == ["QuantizedL2NormKVCache"] * 4
    # Keys: 64 rows of 64 4-bit values (8 words), 2 groups of 32 (a scale and a bias each).
    assert arrays["0.0.0"].shape == (1, 4, 64, 8) and arrays["0.0.0"].dtype == mx.uint32
    assert arrays["0.0.1"].shape == arrays["0.0.2"].shape == (1, 4, 64, 2)
    args = ["--prompt", "def ", "--max-tokens", "24", "--kv-group-size", "32"]
    ours = succeeded(run([*MLX_KNORM, "generate", "--prompt-cache-file", files["budget4096"], *args,
                          *SAMPLING, "--verbose", "F"], env))
    theirs = succeeded(run([*MLX_LM, "generate", "--prompt-cache-file", files["mlx_lm"], *args,
                            *SAMPLING, "--verbose", "F"], env))
    assert ours.stdout == theirs.stdout and ours.stdout.strip()
    small = succeeded(run([*MLX_KNORM, "generate", "--prompt-cache-file", files["budget64"], *args], env)).stdout
    [line] = kv_lines(small)
    from mlx_lm.models.cache import load_prompt_cache

    cached = load_prompt_cache(str(files["budget64"]))[0].offset
    assert evicting(line, 64) and line["tokens"] == cached + mlx_lm_stat(small, "Prompt") + 24 > 64
    assert line["allocated_mb"] == mb(tiny_kv_bytes(64, WIDE_HEAD_DIM, bits=4, group_size=32)) < line["full_mb"]


@pytest.mark.parametrize("case", ["bits", "group size", "norms", "scales"])
def test_generate_refuses_a_quantized_prompt_cache_that_does_not_fit(case, quantized_caches, env, tmp_path):
    source, target, flags = quantized_caches["budget64"], tmp_path / "bad.safetensors", ["--kv-group-size", "32"]
    if case == "bits":
        bad, flags, expect = source, [*flags, "--kv-bits", "8"], "quantized with --kv-bits 4"
    elif case == "group size":
        bad, flags, expect = source, [], "quantized with --kv-group-size 32"
    elif case == "norms":
        bad, expect = _tamper(source, target, arrays=lambda a: {"1.2": a["1.2"] * 1.5}), "field 'norms'"
    else:
        bad = _tamper(source, target, arrays=lambda a: {"2.1.1": a["2.1.1"].astype(mx.float32)})
        expect = "field 'values[1]': dtype float32 differs from the key scales' float16"
    result = run([*MLX_KNORM, "generate", "--prompt-cache-file", bad, "--prompt", "def ", *flags], env)
    assert result.returncode == 1, result.stderr
    assert expect in result.stderr
    assert result.stdout == ""


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text)


def _strip(text: str) -> str:
    """Chat output without colours, and without the lines whose figures vary
    between runs (mlx-lm's speeds) or are ours (the KV memory line)."""
    return "\n".join(line for line in _plain(text).splitlines()
                     if "tok/s" not in line and "KV cache (" not in line)


def test_chat_turns_are_mlx_lm_s_within_the_budget_and_go_on_past_it(tiny, env):
    turns = "hello there\nand once more\nq\n"
    args = ["--model", tiny, "--max-tokens", "24"]
    ours = succeeded(run([*MLX_KNORM, "chat", *args, "--budget", "512"], env, stdin=turns)).stdout
    theirs = succeeded(run([*MLX_LM, "chat", *args], env, stdin=turns)).stdout
    assert _strip(ours) == _strip(theirs)
    lines = kv_lines(ours)
    assert len(lines) == 2 and lines[1]["tokens"] > lines[0]["tokens"]
    # Past the budget: the second turn still answers; the cache stays at the budget.
    small = succeeded(run([*MLX_KNORM, "chat", *args, "--budget", "32"], env, stdin=turns)).stdout
    first, second = kv_lines(small)
    assert second["tokens"] > first["tokens"] > 32
    assert first["allocated_mb"] == second["allocated_mb"] == mb(tiny_kv_bytes(32)) >= second["held_mb"]
    assert len(re.findall(r"^ *24 tokens ·", _plain(small), re.M)) == 2


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # llama defines make_cache, qwen2 does not
def test_install_cache_builds_the_factory_s_cache_from_the_model_s_own(arch):
    import gc
    import weakref

    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from mlx_knorm.cache import L2NormKVCache, make_knorm_cache
    from mlx_knorm.commands.loading import install_cache, model_cache
    from tiny_models import tiny_model

    model = tiny_model(arch)
    install_cache(model, lambda m: make_knorm_cache(m, budget=8))
    install_cache(model, lambda m: make_knorm_cache(m, budget=16, skip_layers=(0,)))
    cache = make_prompt_cache(model, max_kv_size=32)
    assert [type(c) for c in cache] == [KVCache] + [L2NormKVCache] * (len(model.layers) - 1)
    assert {c.budget for c in cache[1:]} == {16}
    assert [type(c) for c in model_cache(model)] == [KVCache] * len(model.layers)
    # No reference cycle through make_cache: the weights go with the last reference.
    alive = weakref.ref(model)
    gc.disable()
    try:
        del model, cache
        assert alive() is None
    finally:
        gc.enable()

"""RULER's synthetic tasks: generation (definitions, answers in the prompt, fixed seeds), scoring (RULER's
string_match_all, recall over every expected answer), the summary's arithmetic, and one short run of the
command through the real caches on the shipped byte-level model (which cannot do the tasks: the run checks
the machinery; the board's figures come from real models)."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm import load

from mlx_knorm.__main__ import main
from mlx_knorm.quality import MODEL_DIR
from mlx_knorm.quality.needle import make_haystack
from mlx_knorm.quality.ruler import RulerRun, greedy_answer, run
from mlx_knorm.quality.ruler_tasks import (ALL_TASKS, CWE_ANSWER, FWE_ANSWER, NIAH, NIAH_ANSWER, NOISE, TASKS,
                                           VT_ANSWER, make_sample, string_match_all, word_lists)
from mlx_knorm.quality.policies import policy_cache

CONTEXT = 2048


@pytest.fixture(scope="module")
def shipped():
    return load(str(MODEL_DIR))


@pytest.fixture(scope="module")
def samples(shipped):
    _, tokenizer = shipped
    return {task: make_sample(task, 3, tokenizer, CONTEXT, max_tokens=32) for task in ALL_TASKS}


def test_rulers_synthetic_set_without_the_qa_tasks():
    assert TASKS == ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
                     "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")
    adjectives, nouns = word_lists()
    assert len(adjectives) > 500 and len(nouns) > 5000 and all(w.isalpha() for w in adjectives + nouns)


@pytest.mark.parametrize("task", ALL_TASKS)
def test_every_prompt_fits_its_context_and_holds_its_answers(samples, task):
    sample = samples[task]
    assert CONTEXT - 32 - 160 < len(sample.tokens) <= CONTEXT - 32  # filled to within one unit (a needle at most)
    assert sample.answers and len(set(sample.answers)) == len(sample.answers)
    body = sample.text
    if task.startswith("niah"):
        spec = {**NIAH, "niah_single_words": None}.get(task)
        kind = {"niah_single_3": "uuids", "niah_multikey_3": "uuids", "niah_single_words": "words"}.get(task, "numbers")
        needles = re.findall(rf"One of the special magic {kind} for (\S+) is: (\S+)\.", body)
        queried = re.search(r"What are all the special magic \w+ for (.+?) mentioned", body).group(1)
        keys = re.split(r", and |, ", queried)
        found = [v for k, v in needles if k in keys]
        assert sorted(found) == sorted(sample.answers)  # every value of every key asked for, and only those
        assert body.endswith(NIAH_ANSWER.format(kind=kind, query=queried))
        if spec is not None:
            assert len(keys) == spec.queries and len(found) == spec.queries * spec.values
            assert len(needles) >= spec.keys * spec.values
            if spec.haystack == "noise":
                assert body.count(NOISE) > 10
            if spec.haystack == "needle":
                assert len(needles) > 10  # the haystack is distractor needles
    elif task == "vt":
        value = re.search(r"assigned the value (\d+) in the text above", body).group(1)
        chain, name = [], None
        for line in body.split("\n"):
            if m := re.fullmatch(rf"VAR ([A-Z]{{5}}) = {value}", line):
                name = m.group(1)
        chain.append(name)
        while m := re.search(rf"VAR ([A-Z]{{5}}) = VAR {chain[-1]}\n", body):
            chain.append(m.group(1))
        assert tuple(chain) == sample.answers and len(chain) == 5
        assert body.endswith(VT_ANSWER.format(count=5, query=value))
    elif task == "cwe":
        words = re.findall(r"\d+\. ([a-z]+)", body)
        counts = Counter(words).most_common()
        assert {w for w, _ in counts[:10]} == set(sample.answers) and counts[9][1] > counts[10][1]
        assert body.endswith(CWE_ANSWER)
    else:
        coded = body.split("coded words. ", 1)[1].split("\nQuestion:")[0].split(" .... ")
        counts = Counter(coded)
        top = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:3]
        assert tuple(w for w, _ in top) == sample.answers
        assert body.endswith(FWE_ANSWER)


def test_samples_are_fixed_by_seed_task_and_index(shipped, samples):
    _, tokenizer = shipped
    again = make_sample("niah_multikey_1", 3, tokenizer, CONTEXT, max_tokens=32)
    assert again == samples["niah_multikey_1"]
    assert make_sample("niah_multikey_1", 4, tokenizer, CONTEXT, max_tokens=32).answers != again.answers
    assert make_sample("niah_multikey_1", 3, tokenizer, CONTEXT, seed=1, max_tokens=32).answers != again.answers


def test_a_users_text_is_the_essay_haystack(shipped):
    _, tokenizer = shipped
    text = "Tulips open at dawn. Herons wait in the reeds! Who counts the stones? Nobody does."
    sample = make_sample("niah_single_2", 0, tokenizer, 1024, haystack_text=text, max_tokens=16)
    assert sample.text.count("Herons wait in the reeds!") > 3 and "statement" not in sample.text
    with pytest.raises(ValueError, match="no words"):
        make_sample("niah_single_2", 0, tokenizer, 1024, haystack_text=" \n ", max_tokens=16)


@pytest.mark.parametrize("kwargs,match", [
    ({"task": "qa_1"}, "task must be one of"),
    ({"context": 0}, "context must be"),
    ({"max_tokens": 0}, "max_tokens must be"),
    ({"context": 300}, "niah_multikey_1: a context of 300 tokens has no room"),
])
def test_bad_arguments_are_refused_by_name(shipped, kwargs, match):
    _, tokenizer = shipped
    args = {"task": "niah_multikey_1", "index": 0, "tokenizer": tokenizer, "context": 1024, **kwargs}
    with pytest.raises(ValueError, match=match):
        make_sample(**args)


def test_string_match_all_is_the_share_of_answers_found_case_insensitive():
    assert string_match_all("The numbers are 1234567 and 7654321.", ["1234567", "7654321"]) == 1.0
    assert string_match_all("only 1234567", ["1234567", "7654321", "5555555", "6666666"]) == 0.25
    assert string_match_all("ALPHA-beta", ["alpha-BETA"]) == 1.0
    assert string_match_all("", ["x"]) == 0.0
    with pytest.raises(ValueError, match="answers"):
        string_match_all("x", [])


@given(st.lists(st.text(alphabet="abcdef0123", min_size=1, max_size=6), min_size=1, max_size=5, unique=True),
       st.data())
def test_string_match_all_counts_each_answer_present(answers, data):
    present = data.draw(st.lists(st.sampled_from(answers), unique=True))
    prediction = " | ".join(present)
    expected = sum(a in prediction for a in answers) / len(answers)
    assert string_match_all(prediction, answers) == expected
    assert string_match_all(prediction, answers) >= len(present) / len(answers)


def test_the_summary_averages_tasks_and_pairs_each_policy_with_the_window():
    config = {"tasks": ["a", "b"], "samples_per_task": 3, "budget_fractions": [0.5],
              "policies": ["window", "keep-low"], "context": 100}
    scores = {("full", None): [[1, 1, 1], [1, 1, 0.5]], ("window", 0.5): [[0, 1, 0], [0, 0, 0]],
              ("keep-low", 0.5): [[1, 1, 0], [0.5, 0, 0]]}
    result = RulerRun(config)
    for t, task in enumerate(config["tasks"]):
        for i in range(3):
            outputs = {(p if f is None else f"{p}@{f:g}"): {"output": "", "score": s[t][i]}
                       for (p, f), s in scores.items()}
            result.samples.append({"task": task, "index": i, "outputs": outputs})
    rows = {(r["policy"], r["budget_fraction"]): r for r in result.summary()}
    assert rows["full", None]["average"] == pytest.approx(100 * 5.5 / 6)
    assert rows["keep-low", 0.5]["tasks"]["a"]["score"] == pytest.approx(200 / 3)
    assert rows["keep-low", 0.5]["average"] == pytest.approx(100 * 2.5 / 6)
    assert rows["keep-low", 0.5]["minus_window"] == pytest.approx(100 * 1.5 / 6)
    low, high = rows["keep-low", 0.5]["minus_window_ci"]
    assert low <= rows["keep-low", 0.5]["minus_window"] <= high
    assert "minus_window" not in rows["window", 0.5] and rows["window", 0.5]["compression"] == 0.5


def test_the_answer_is_generate_steps_greedy_continuation(shipped, samples):
    model, tokenizer = shipped
    sample = samples["niah_single_1"]
    text = greedy_answer(model, tokenizer, sample.tokens, policy_cache(model, None, 0, CONTEXT), 256, 12,
                         sample.answers)
    from mlx_lm.generate import generate_step
    import mlx.core as mx

    ids = [t for t, _ in generate_step(mx.array(sample.tokens), model, max_tokens=12,
                                       prompt_cache=policy_cache(model, None, 0, CONTEXT), prefill_step_size=256)]
    assert text == tokenizer.decode(ids)
    # Stopped as soon as every answer is in it: an answer made of the model's first tokens ends there.
    first = tokenizer.decode(ids[:3])
    assert greedy_answer(model, tokenizer, sample.tokens, policy_cache(model, None, 0, CONTEXT), 256, 12,
                         (first,)) == first


def test_the_command_runs_the_named_policies_through_their_caches_and_writes_json_and_a_plot(tmp_path, capsys):
    out, png = tmp_path / "ruler.json", tmp_path / "ruler.png"
    argv = ["ruler", "--model", str(MODEL_DIR), "--tasks", "niah_single_1,vt", "--context", "700",
            "--budgets", "0.25", "--policies", "keydiff+recent=1/2 window", "--samples", "2", "--max-tokens", "6",
            "--prefill-step-size", "128", "--json", str(out), "--plot", str(png)]
    assert main(argv) == 0
    assert "| keydiff+recent=1/2 | 75.0% |" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["policies"] == ["keydiff+recent=1/2", "window"] and report["samples_per_task"] == 2
    assert len(report["samples"]) == 4
    for sample in report["samples"]:
        assert set(sample["outputs"]) == {"full", "keydiff+recent=1/2@0.25", "window@0.25"}
        for output in sample["outputs"].values():
            assert output["score"] == string_match_all(output["output"], sample["answers"])
    assert png.stat().st_size > 0
    assert main(["ruler", "--model", str(MODEL_DIR), "--tasks", "cwe", "--context", "300"]) == 2
    assert "cwe: a context of 300 tokens has no room" in capsys.readouterr().err
    assert main(["ruler", "--model", str(MODEL_DIR), "--haystack", str(tmp_path / "missing.txt")]) == 2
    assert "--haystack" in capsys.readouterr().err


def test_run_refuses_bad_arguments_by_name(shipped):
    model, tokenizer = shipped
    for kwargs, match in (({"samples": 0}, "samples must be"), ({"fractions": (1.0,)}, "budget fractions"),
                          ({"tasks": []}, "tasks must be"), ({"policies": ["window", "window"]}, "distinct")):
        with pytest.raises(ValueError, match=match):
            run(model, tokenizer, **{"tasks": ["vt"], "context": 512, **kwargs})


def test_needle_takes_a_users_text_as_its_prose_haystack(shipped, tmp_path, capsys):
    _, tokenizer = shipped
    text = "Tulips open at dawn.\nHerons wait in the reeds.\n\nNobody counts the stones.\n"
    haystack = make_haystack("prose", tokenizer, 600, text)
    assert "Herons wait" in tokenizer.decode(list(haystack.filler)) and haystack.starts and haystack.ends
    with pytest.raises(ValueError, match="goes with the prose haystack"):
        make_haystack("passkey", tokenizer, 600, text)
    path = tmp_path / "hay.txt"
    path.write_text(text)
    out = tmp_path / "needle.json"
    assert main(["needle", "--model", str(MODEL_DIR), "--haystack", str(path), "--contexts", "400", "--depths", "0.5",
                 "--budgets", "0.25", "--policies", "vnorm", "--prefill-step-size", "128", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["haystacks"] == ["prose"] and report["prose_text"] == "user text"
    assert {t["policy"] for t in report["trials"]} == {"full", "vnorm"}
    assert main(["needle", "--model", str(MODEL_DIR), "--haystack", str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt" in capsys.readouterr().err


def test_replayed_chunks_leave_the_outputs_as_they_are(shipped):
    model, tokenizer = shipped
    kwargs = {"tasks": ["niah_single_2", "vt"], "context": 800, "fractions": (0.5, 0.25),
              "policies": ["keep-low+recent=1/2", "window", "random", "keydiff"], "samples": 1,
              "max_tokens": 6, "prefill_step_size": 64}
    replayed = run(model, tokenizer, **kwargs)
    plain = run(model, tokenizer, replay=False, **kwargs)
    assert [s["outputs"] for s in replayed.samples] == [s["outputs"] for s in plain.samples]
    assert replayed.config["replayed_tokens"] > replayed.config["prompt_tokens_read"] // 4
    assert plain.config["replayed_tokens"] == 0 == plain.config["recorded_tokens"]
    # The full cache's forward over each sample's whole chunks, computed once for every cache.
    assert replayed.config["recorded_tokens"] <= sum(s["prompt_tokens"] for s in replayed.samples)

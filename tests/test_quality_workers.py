"""``--jobs``: the eval and the needle grid in worker processes give the numbers of one process."""

from __future__ import annotations

import pytest
from mlx_lm import load

from mlx_knorm.quality import MODEL_DIR, data
from mlx_knorm.quality.eval import evaluate
from mlx_knorm.quality.needle import run_grid
from mlx_knorm.quality.workers import ModelSpec, map_tasks

SPEC = ModelSpec(str(MODEL_DIR))


@pytest.fixture(scope="module")
def shipped():
    return load(str(MODEL_DIR))


class CountingBar:
    def __init__(self):
        self.total = 0

    def update(self, n=1):
        self.total += n


def test_eval_in_two_processes_gives_the_numbers_of_one(shipped):
    model, tokenizer = shipped
    sequences = data.document_sequences(tokenizer, data.heldout_texts(), 96, 3)
    kwargs = {"fractions": (0.25, 0.5), "policies": ["keep-low", "random", "window", "keep-low+recent=1/2"]}
    one = evaluate(model, sequences, **kwargs).report()
    two = evaluate(model, sequences, jobs=2, model_spec=SPEC, **kwargs).report()
    assert len(one["per_sequence"]["nll"]["full"]) == 3
    # Random eviction draws its key from the window's index, wherever the window runs.
    assert two == one


def test_needle_grid_in_two_processes_gives_the_trials_of_one(shipped):
    model, tokenizer = shipped
    kwargs = {"haystacks": ("passkey",), "contexts": (320, 400), "depths": (0.0, 1.0), "fractions": (0.25,),
              "policies": ["keep-low", "random", "window"], "keys": 2, "prefill_step_size": 64}
    one = run_grid(model, tokenizer, **kwargs)
    two = run_grid(model, tokenizer, jobs=3, model_spec=SPEC, **kwargs)
    assert len(one.trials) == 2 * 2 * 2 * 4
    assert two.trials == one.trials and two.prefill_tokens == one.prefill_tokens


def _fail_on_two(model, tokenizer, task, bar):
    bar.update(task)
    if task == 2:
        raise ValueError("task 2 refused")
    return task * 10


def test_tasks_run_in_order_report_progress_and_raise_their_errors():
    bar = CountingBar()
    assert map_tasks(_fail_on_two, [4, 1, 3], jobs=2, bar=bar, model_spec=SPEC, costs=[1, 3, 2]) == [40, 10, 30]
    assert bar.total == 8  # every worker's updates, before map_tasks returns
    with pytest.raises(ValueError, match="task 2 refused"):
        map_tasks(_fail_on_two, [1, 2, 3], jobs=2, bar=CountingBar(), model_spec=SPEC)


@pytest.mark.parametrize("kwargs, match", [({"jobs": 0}, "jobs must be a positive int"),
                                           ({"jobs": True}, "jobs must be a positive int"),
                                           ({"jobs": 2}, "jobs > 1 needs model_spec"),
                                           ({"jobs": 2, "model_spec": str(MODEL_DIR)}, "jobs > 1 needs model_spec")])
def test_bad_jobs_are_named(shipped, kwargs, match):
    model, tokenizer = shipped
    sequences = data.document_sequences(tokenizer, data.heldout_texts(), 32, 1)
    with pytest.raises(ValueError, match=match):
        evaluate(model, sequences, **kwargs)
    with pytest.raises(ValueError, match=match):
        run_grid(model, tokenizer, contexts=(200,), **kwargs)


def _pid(model, tokenizer, task, bar):
    """This process's id, once ``task`` (a folder, a count) shows that many processes at work in the folder.

    The wait makes the test independent of which worker is ready first: a
    worker that finished every task before the other started would be
    correct, but show nothing.
    """
    import os
    import time
    from pathlib import Path

    folder, processes = task
    if folder is not None:
        Path(folder, str(os.getpid())).touch()
        deadline = time.monotonic() + 120
        while len(list(Path(folder).iterdir())) < processes and time.monotonic() < deadline:
            time.sleep(0.01)
    return os.getpid()


def test_tasks_run_in_as_many_other_processes_as_asked(tmp_path):
    import os

    pids = map_tasks(_pid, [(str(tmp_path), 2)] * 6, jobs=2, bar=CountingBar(), model_spec=SPEC)
    assert os.getpid() not in pids and len(set(pids)) == 2
    assert map_tasks(_pid, [(None, 1)] * 2, jobs=1, bar=CountingBar()) == [os.getpid()] * 2

"""Worker processes for the eval and the needle grid: ``map_tasks``.

Both split into independent tasks (the eval: one window; the needle grid:
one policy at one number of rows per layer, on one haystack) whose results do not depend on the process or
the order they run in (every random key is derived from the task's own
indices). ``map_tasks`` runs them in ``jobs`` spawned processes, each of
which loads the model once from a ``ModelSpec`` and runs with one BLAS
thread: on a CPU, one single-threaded process per core keeps the cores
busier than one process whose threaded BLAS spins and yields between the
small matmuls of a small model (docs/results/quality-smollm2.md has the measurement).
Each process holds its own copy of the weights.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import os
import threading
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

# Read by the BLAS libraries when they load: OpenBLAS, and Accelerate on macOS.
_ONE_BLAS_THREAD = {"OPENBLAS_NUM_THREADS": "1", "VECLIB_MAXIMUM_THREADS": "1"}


@dataclass(frozen=True)
class ModelSpec:
    """What ``mlx_knorm.models.load`` is given, to load the same model in another process."""

    model: str
    dtype: str | None = None
    requantize: tuple[int, int] | None = None

    def load(self, **kwargs):
        """``mlx_knorm.models.load`` of this model; ``kwargs`` go to it (``return_config``)."""
        from ..models import load

        return load(self.model, dtype=self.dtype, requantize=self.requantize, **kwargs)


def check_jobs(jobs, model_spec) -> None:
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be a positive int, got {jobs!r}")
    if jobs > 1 and not isinstance(model_spec, ModelSpec):
        raise ValueError(f"jobs > 1 needs model_spec, a ModelSpec to load the model in each process, "
                         f"got {model_spec!r}")


class _QueueBar:
    """A progress bar in a worker: its updates go to the parent's bar through a queue."""

    def __init__(self, queue):
        self.queue = queue

    def update(self, n=1):
        self.queue.put(n)


_worker = {}  # in a worker process: its model, tokenizer and progress queue


def _start_worker(spec: ModelSpec, queue, device: str) -> None:
    import mlx.core as mx

    mx.set_default_device(getattr(mx, device))
    # The parent printed what loading reports (tensor types converted); once is enough.
    with contextlib.redirect_stderr(io.StringIO()):
        _worker["model"], _worker["tokenizer"] = spec.load()
    _worker["bar"] = _QueueBar(queue)


def _run_task(fn, task):
    return fn(_worker["model"], _worker["tokenizer"], task, _worker["bar"])


@contextlib.contextmanager
def _environment(values: dict):
    """``values`` set in ``os.environ`` where not already set (spawned processes inherit it), then undone."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def _auto_dtype_outcome(model) -> dict:
    """The environment that makes a worker's ``dtype="auto"`` come out as this process's did for ``model``."""
    if model is None:
        return {}
    from ..models.loader import AUTO_FLOAT32_ENV, all_float32

    return {AUTO_FLOAT32_ENV: "1" if all_float32(model) else "0"}


def map_tasks(fn, tasks: list, *, jobs: int, bar, model=None, tokenizer=None, model_spec: ModelSpec | None = None,
              costs: list | None = None) -> list:
    """``[fn(model, tokenizer, task, bar) for task in tasks]``, in ``min(jobs, len(tasks))`` processes if more than one.

    ``fn`` and the tasks must pickle (``fn`` a module-level function or a
    ``functools.partial`` of one). In processes, each loads ``model_spec``
    once on this process's default device, ``bar.update`` calls reach
    ``bar`` in this process, and tasks
    start most ``costs`` first (a longest-first schedule); the results come
    back in the order of ``tasks``. A task's exception is raised here.
    """
    workers = min(jobs, len(tasks))
    if workers <= 1:
        return [fn(model, tokenizer, task, bar) for task in tasks]
    import mlx.core as mx

    order = sorted(range(len(tasks)), key=lambda i: -costs[i]) if costs else range(len(tasks))
    device = "gpu" if mx.default_device() == mx.gpu else "cpu"
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()

    def forward_progress():
        for n in iter(queue.get, None):
            bar.update(n)

    forwarder = threading.Thread(target=forward_progress, daemon=True)
    forwarder.start()
    try:
        with _environment({**_ONE_BLAS_THREAD, **_auto_dtype_outcome(model)}):
            pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker,
                                       initargs=(model_spec, queue, device))
            futures = {i: pool.submit(_run_task, fn, tasks[i]) for i in order}
        try:
            return [futures[i].result() for i in range(len(tasks))]
        finally:
            # After a failure, tasks not yet started never start; running ones finish.
            pool.shutdown(wait=True, cancel_futures=True)
    finally:
        queue.put(None)  # after every worker has exited, so after their updates
        forwarder.join()
        queue.close()

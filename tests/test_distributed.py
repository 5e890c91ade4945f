"""make_knorm_cache on models split over mx.distributed: two local ranks on
MLX's ring backend, launched with ``mlx.launch`` as a user would, give the
logits of the single-process run far past the budget."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import distributed_worker
from distributed_worker import BLOCKS, BUDGET, SCENARIOS

RANKS = 2
LAUNCH_TIMEOUT_S = 120
# Tensor parallelism sums each layer's output over the ranks in another order
# than one process does (measured: 3.7e-5 at most); pipeline parallelism runs
# the same operations, its first layer uncompressed on the rank that holds it.
LOGIT_TOLERANCE = {"tensor": 5e-5, "pipeline": 0.0}


def free_port_pair() -> int:
    """A port p with p and p + 1 free on localhost: the ring backend's rank r
    listens on starting_port + r."""
    for _ in range(50):
        with socket.socket() as first, socket.socket() as second:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            try:
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[str, list[dict[str, np.ndarray]]]:
    """Each scenario's results from every rank of one `mlx.launch` run."""
    out = tmp_path_factory.mktemp("distributed")
    launcher = Path(sys.executable).with_name("mlx.launch")
    assert launcher.exists(), f"mlx installs the mlx.launch entry point next to {sys.executable}"
    command = [
        str(launcher), "--backend", "ring", "-n", str(RANKS),
        "--starting-port", str(free_port_pair()), "--python", sys.executable,
        str(Path(distributed_worker.__file__)), str(out),
    ]
    log_path = out / "launch.log"
    with open(log_path, "wb") as log:
        # Its own session, so that a timeout ends the launcher and both ranks.
        # stdin stays an open pipe: the launcher forwards it to the ranks and
        # would spin on a closed one.
        # mlx.launch leaves its pid and host files in $TMPDIR: keep them in out.
        launch = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "TMPDIR": str(out)},
        )
        try:
            launch.wait(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(launch.pid, signal.SIGKILL)
            launch.wait()
            pytest.fail(f"mlx.launch ran past {LAUNCH_TIMEOUT_S} s:\n{log_path.read_text()}")
        finally:
            launch.stdin.close()
    results = {}
    for scenario in SCENARIOS:
        paths = [out / f"{scenario}.rank{rank}.npz" for rank in range(RANKS)]
        # mlx.launch exits 0 even when a rank fails: the outputs say whether they ran.
        assert all(p.exists() for p in paths), f"{scenario}: a rank wrote no result:\n{log_path.read_text()}"
        results[scenario] = [dict(np.load(p)) for p in paths]
    return results


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_two_ranks_give_the_single_process_logits_past_the_budget(ranks, scenario):
    expected = distributed_worker.decode(scenario, group=None)
    seen = np.cumsum(BLOCKS)
    # Eviction ran: every compressed layer is full from the first call on.
    assert (expected["most_rows"] == BUDGET).all()
    for rank, got in enumerate(ranks[scenario]):
        assert got["size"] == RANKS
        assert got["logits"].shape == expected["logits"].shape
        difference = np.abs(got["logits"] - expected["logits"]).max()
        assert difference <= LOGIT_TOLERANCE[scenario], f"rank {rank}: logits differ by {difference}"
        # Each rank's layers (all of them, its heads; or its share of the
        # layers, all heads) never hold more than the budget, and count positions.
        assert (got["most_rows"] == BUDGET).all()
        assert (got["offsets"] == seen[:, None]).all()

"""A tiny model split over ``mx.distributed`` decoding far past the budget
with ``make_knorm_cache``: one rank's work, or the single-process run it is
compared with (``group=None``).

tests/test_distributed.py launches it as a user would:

    mlx.launch --backend ring -n 2 --python PYTHON tests/distributed_worker.py OUT_DIR

and each rank runs every scenario and writes ``OUT_DIR/<scenario>.rank<r>.npz``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_knorm.cache import L2NormKVCache, make_knorm_cache
from tiny_models import teacher_forced, tiny_model, tokens

BUDGET = 24
N_SINK = 4
# Chunked prefill past the budget, then decoding with one mid-stream block:
# every call after the first evicts.
BLOCKS = [40, 17] + [1] * 30 + [5] + [1] * 30

# Each scenario's model, how it is split over a group (tensor parallel
# through the model's shard(), pipeline parallel through its pipeline()), and
# the layers of the whole model left uncompressed.
SCENARIOS = {
    "tensor": ("llama", lambda model, group: model.shard(group), ()),
    "pipeline": ("deepseek_v2", lambda model, group: model.model.pipeline(group), (0,)),
}


def local_skip_layers(model, skip_layers) -> list[int]:
    """Layers of the whole model as indices into this process's ``model.layers``:
    after ``pipeline()`` a rank holds layers ``[start_idx, start_idx + len(model.layers))``."""
    first = getattr(model.model, "start_idx", 0)
    return [layer - first for layer in skip_layers if first <= layer < first + len(model.layers)]


def decode(scenario: str, group: mx.distributed.Group | None) -> dict[str, np.ndarray]:
    """Logits of every position, and after each call the most rows any
    compressed layer of this process holds and every layer's offset."""
    arch, split, skip_layers = SCENARIOS[scenario]
    # float32 weights: the sharded and the single-process runs add partial
    # sums in different orders, and float32 keeps that difference small.
    model = tiny_model(arch, mx.float32, layers=4)
    if group is not None:
        split(model, group)
    cache = make_knorm_cache(model, budget=BUDGET, n_sink=N_SINK, skip_layers=local_skip_layers(model, skip_layers))
    most_rows, offsets = [], []

    def record(cache):
        most_rows.append(max(layer.size() for layer in cache if isinstance(layer, L2NormKVCache)))
        offsets.append([layer.offset for layer in cache])

    ids = tokens(1, sum(BLOCKS), seed=41)
    logits = teacher_forced(model, cache, ids, BLOCKS, after_step=record)
    return {
        "logits": np.array(mx.concatenate(logits, axis=1)),
        "most_rows": np.array(most_rows),
        "offsets": np.array(offsets),
    }


def main(out_dir: str) -> None:
    group = mx.distributed.init(strict=True, backend="ring")
    for scenario in SCENARIOS:
        result = decode(scenario, group)
        np.savez(Path(out_dir) / f"{scenario}.rank{group.rank()}.npz", size=group.size(), **result)


if __name__ == "__main__":
    main(*sys.argv[1:])

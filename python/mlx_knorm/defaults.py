"""The cache's default settings: one source for ``mlx_knorm.cache``, the
command line and the benchmarks. MLX alone imports this module (no mlx-lm),
so that commands can show the defaults in their help."""

from __future__ import annotations

from fractions import Fraction

import mlx.core as mx

# L2NormKVCache's, as the reference's cache (its config fields knorm_*).
DEFAULT_BUDGET = 512
DEFAULT_N_SINK = 4
DEFAULT_RECENT = 0  # no recent window: the paper's pure keep-low
DEFAULT_KEEP = "low"
DEFAULT_LAYOUT = "slots"

# The caches evict through the order tree (docs/spec.md §4 step 4, §8) in
# the slot layout from these budgets on, without a recent window and with
# one. Measured by bench/order_tree.py (bench/results/order-tree-cpu.json):
# without a window the tree's decode step takes 0.96x-1.01x of ranking every
# row at 1024, 0.92x (32 heads) to 0.99x (8 heads) at 2048 and 0.48x-0.93x
# from 4096 on; with a window of half the budget each step also updates the
# leaving row's path in both halves: 1.03x-1.04x at 1024, 0.92x-1.01x at
# 2048, 0.56x-0.94x from 4096 on. These are the CPU kernel's figures. On a
# GPU no step reads a given tree (the Metal kernel and the fallback build it
# over every output, spec §10): a tree there would cost a dispatch a step
# and buy nothing, so GPU caches keep none (nor do caches stepping through
# the Metal emulator, cache.order_tree_argument).
ORDER_TREE_MIN_BUDGET = 2048
ORDER_TREE_MIN_BUDGET_WITH_WINDOW = 4096


def uses_order_tree(layout: str, budget: int, recent: int,
                    device: mx.Stream | mx.Device | mx.DeviceType | None = None) -> bool:
    """Whether a cache of this configuration keeps the order tree when its
    step runs on ``device`` (a stream, device or device type; the default
    device when None): on the CPU only."""
    least = ORDER_TREE_MIN_BUDGET if recent == 0 else ORDER_TREE_MIN_BUDGET_WITH_WINDOW
    if layout != "slots" or budget < least:
        return False
    # Asked on every decode step: the device only where the configuration gains.
    if device is None:
        device = mx.default_device()
    if isinstance(device, mx.Stream):
        device = device.device
    return (device.type if isinstance(device, mx.Device) else device) == mx.DeviceType.cpu


# make_knorm_cache's recent window when none is given, as a share of the
# budget (docs/quality.md has the evidence, measured on SmolLM2-135M).
DEFAULT_RECENT_SHARE = Fraction(1, 2)
# make_knorm_cache's uncompressed layers when none are given.
DEFAULT_SKIP_LAYERS: tuple[int, ...] = ()
# The quantized cache's group size when none is given: mlx-lm's kv_group_size default.
DEFAULT_KV_GROUP_SIZE = 64


def share_of(share: Fraction, budget: int) -> int:
    """``share`` of ``budget`` rows, rounded to the nearest (half to even)."""
    return int(round(share * budget))


def default_recent(budget: int, n_sink: int = DEFAULT_N_SINK) -> int:
    """``make_knorm_cache``'s recent window at ``budget``: ``DEFAULT_RECENT_SHARE`` of it,
    less where that would leave no evictable row (``n_sink + recent < budget``)."""
    return max(0, min(share_of(DEFAULT_RECENT_SHARE, budget), budget - n_sink - 1))

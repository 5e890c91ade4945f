"""docs/spec.md §6: every bad input raises a clear error before any work."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_knorm
from conftest import ALL_BACKENDS, requires_emulator
from mlx_knorm import _native
from mlx_knorm.ops.evict_and_fill import evict_and_fill_unchecked
from mlx_knorm.ops.key_norms import key_norms_unchecked
from mlx_knorm.ops.protected_topk_gather import protected_topk_gather_unchecked


def good_protected_topk_gather_args(n=2, n_prior=5, s=3, d=8, dtype=mx.float16):
    return dict(
        prior_keys=mx.zeros((n, n_prior, d), dtype),
        prior_values=mx.zeros((n, n_prior, d), dtype),
        prior_norms=mx.zeros((n, n_prior)),
        new_keys=mx.ones((n, s, d), dtype),
        new_values=mx.ones((n, s, d), dtype),
        budget=6,
        n_sink=1,
        recent=1,
        keep="low",
    )


PROTECTED_TOPK_GATHER_SHAPE_ERRORS = [
    (dict(new_values=mx.ones((2, 4, 8), mx.float16)), "keys/values mismatch in N or rows"),
    (dict(prior_values=mx.ones((2, 4, 8), mx.float16)), "keys/values mismatch in N or rows"),
    (dict(prior_values=mx.ones((2, 5, 7), mx.float16)), "prior vs new mismatch in N or D"),
    (dict(new_keys=mx.ones((3, 3, 8)), new_values=mx.ones((3, 3, 8))), "prior vs new mismatch in N or D"),
    (dict(new_keys=mx.ones((2, 3, 4)), new_values=mx.ones((2, 3, 4))), "prior vs new mismatch in N or D"),
    (dict(prior_norms=mx.zeros((2, 4))), "prior_norms must be [N, n_prior]"),
    (dict(prior_norms=mx.zeros((2, 5, 1))), "prior_norms must have rank 2"),
    (dict(new_keys=mx.ones((3, 8))), "new_keys must have rank 3"),
    (dict(budget=0), "budget must be >= 1"),
    (dict(n_sink=-1), "n_sink must be >= 0"),
    (dict(recent=-2), "recent must be >= 0"),
    (dict(n_sink=3, recent=3), "must be < budget"),
    (dict(keep="middle"), "keep must be 'low' or 'high'"),
    # docs/spec.md §5's limits, on heads without elements (no memory).
    (good_protected_topk_gather_args(n=0, n_prior=2**31 - 3, s=3), "n_prior + S (2147483648) must be < 2**31"),
    (good_protected_topk_gather_args(n=0, d=2**30, dtype=mx.float16),
     "prior_keys has rows of 2147483648 bytes; rows must be < 2**31 bytes"),
    ({**good_protected_topk_gather_args(n=0), "prior_values": mx.zeros((0, 5, 2**29)),
      "new_values": mx.zeros((0, 3, 2**29))},
     "prior_values has rows of 2147483648 bytes"),
]
# The largest calls within docs/spec.md §5's limits, on heads without
# elements: accepted on every backend, one row, byte or slot below the
# calls above that are refused. Each runs in a subprocess whose address
# space is capped, so a backend that sized host scratch by the rows (4 bytes
# a row is 8 GB here) fails the test instead of the machine. The fallback
# builds its selection from the shapes as arrays of the rows (8 bytes a row),
# so it is not run at the row limit.
AT_THE_LIMITS_SCRIPT = """
import resource, sys
sys.path.insert(0, sys.argv[2])
import mlx.core as mx
import mlx_knorm
from test_validation import good_evict_and_fill_args, good_protected_topk_gather_args

backend = sys.argv[1]
calls = [
    ("n_prior + S = 2**31 - 1", mlx_knorm.knorm_update_batched,
     good_protected_topk_gather_args(n=0, n_prior=2**31 - 4, s=3), (0, 6, 8)),
    ("gather rows of 2**31 - 2 bytes", mlx_knorm.knorm_update_batched,
     {**good_protected_topk_gather_args(n=0), "prior_values": mx.zeros((0, 5, 2**30 - 1), mx.float16),
      "new_values": mx.zeros((0, 3, 2**30 - 1), mx.float16)}, (0, 6, 8)),
    ("capacity = 2**31 - 1", mlx_knorm.evict_and_fill,
     {**good_evict_and_fill_args(n=0), "capacity": 2**31 - 1}, (0, 2**31 - 1, 8)),
    ("offset + S = 2**31 - 1", mlx_knorm.evict_and_fill,
     {**good_evict_and_fill_args(n=0), "offset": 2**31 - 2}, (0, 6, 8)),
    ("step rows of 2**31 - 1 bytes", mlx_knorm.evict_and_fill,
     {**good_evict_and_fill_args(n=0), "values": mx.zeros((0, 6, 2**31 - 1), mx.uint8),
      "new_values": mx.zeros((0, 1, 2**31 - 1), mx.uint8)}, (0, 6, 8)),
]
if backend == "fallback":
    calls = calls[1:]
with open("/proc/self/status") as status:
    used = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (used + (2 << 30), resource.getrlimit(resource.RLIMIT_AS)[1]))
with mlx_knorm.use_backend(backend):
    for name, op, args, keys_shape in calls:
        outputs = op(**args)
        mx.eval(outputs)
        assert outputs[0].shape == keys_shape, (name, outputs[0].shape)
        print("accepted:", name)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_the_largest_calls_within_the_limits_are_accepted(backend):
    tests_dir = str(Path(__file__).resolve().parent)
    result = subprocess.run([sys.executable, "-c", AT_THE_LIMITS_SCRIPT, backend, tests_dir],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("accepted:") == (4 if backend == "fallback" else 5), result.stdout


PROTECTED_TOPK_GATHER_TYPE_ERRORS = [
    (dict(new_keys=mx.ones((2, 3, 8), mx.int32)), "new_keys must be float16, bfloat16 or float32"),
    (dict(prior_values=mx.zeros((2, 5, 8), mx.uint8)), "prior_values must be float16"),
    (dict(prior_norms=mx.zeros((2, 5), mx.float16)), "prior_norms must be float32"),
    (dict(budget=6.0), "budget must be an int"),
    (dict(budget=mx.array(6)), "budget must be an int, got array"),
    (dict(n_sink=None), "n_sink must be an int, got NoneType"),
    (dict(recent=np.array(1)), "recent must be an int, got ndarray"),
    (dict(keep=None), "keep must be a str, got NoneType"),
    (dict(prior_keys=[[0.0]]), "prior_keys must be an mlx.core.array"),
    (dict(new_values=None), "new_values must be an mlx.core.array, got NoneType"),
]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("change, fragment", PROTECTED_TOPK_GATHER_SHAPE_ERRORS)
def test_protected_topk_gather_value_errors(backend, change, fragment):
    with mlx_knorm.use_backend(backend), pytest.raises(ValueError, match=re.escape(fragment)):
        mlx_knorm.knorm_update_batched(**{**good_protected_topk_gather_args(), **change})


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("change, fragment", PROTECTED_TOPK_GATHER_TYPE_ERRORS)
def test_protected_topk_gather_type_errors(backend, change, fragment):
    with mlx_knorm.use_backend(backend), pytest.raises(TypeError, match=fragment):
        mlx_knorm.knorm_update_batched(**{**good_protected_topk_gather_args(), **change})


def test_protected_topk_gather_messages_name_the_shapes():
    with pytest.raises(ValueError, match=r"new_keys \[2, 3, 8\] vs new_values \[2, 4, 8\]"):
        mlx_knorm.knorm_update_batched(
            **{**good_protected_topk_gather_args(), "new_values": mx.ones((2, 4, 8), mx.float16)})


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_protected_topk_gather_empty_blocks_are_valid(backend):
    with mlx_knorm.use_backend(backend):
        keys, values, norms = mlx_knorm.knorm_update_batched(**good_protected_topk_gather_args(n_prior=0, s=0))
        assert keys.shape == (2, 0, 8) and norms.shape == (2, 0)
        keys, _, _ = mlx_knorm.knorm_update_batched(**good_protected_topk_gather_args(n_prior=4, s=0))
        assert keys.shape == (2, 4, 8)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_protected_topk_gather_converts_numpy_integers_before_any_arithmetic(backend):
    """np.uint8(200) + np.uint8(100) wraps to 44; the checks must see 300."""
    with mlx_knorm.use_backend(backend), pytest.raises(ValueError, match=r"n_sink \(200\) \+ recent \(100\)"):
        mlx_knorm.knorm_update_batched(
            **{**good_protected_topk_gather_args(), "budget": 50, "n_sink": np.uint8(200), "recent": np.uint8(100)})
    with pytest.raises(ValueError, match=r"n_sink \(100\) \+ recent \(100\)"):
        mlx_knorm.init_knorm_state(n_sink=np.int8(100), budget=np.int8(127), head_dim=8, recent=np.int8(100))
    state = mlx_knorm.init_knorm_state(n_sink=np.int8(2), budget=np.int64(6), head_dim=np.int16(8))
    assert type(state.budget) is int and type(state.n_sink) is int


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_protected_topk_gather_names_missing_norms(backend):
    """None where an array belongs is a TypeError naming it, on every backend."""
    a = good_protected_topk_gather_args()
    with mlx_knorm.use_backend(backend), pytest.raises(TypeError, match="new_norms must be an mlx.core.array, got NoneType"):
        mlx_knorm.protected_topk_gather(
            a["prior_keys"], a["prior_values"], a["prior_norms"], a["new_keys"], a["new_values"],
            None, 6, 1, 1, "low",
        )


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_protected_topk_gather_keys_and_values_may_differ_in_width(backend):
    """Multi-head latent attention stores keys of dim 192 beside values of dim 128."""
    a = good_protected_topk_gather_args()
    a["prior_values"] = mx.zeros((2, 5, 3), mx.float16)
    a["new_values"] = mx.ones((2, 3, 3), mx.float16)
    with mlx_knorm.use_backend(backend):
        keys, values, norms = mlx_knorm.knorm_update_batched(**a)
    assert keys.shape == (2, 6, 8) and values.shape == (2, 6, 3) and norms.shape == (2, 6)


def test_protected_topk_gather_requires_matching_dtypes():
    args = good_protected_topk_gather_args()
    with pytest.raises(TypeError, match="new_keys dtype float32 must equal prior_keys dtype float16"):
        mlx_knorm.protected_topk_gather(
            args["prior_keys"], args["prior_values"], args["prior_norms"],
            args["new_keys"].astype(mx.float32), args["new_values"], mx.zeros((2, 3)),
            6, 1, 1, "low",
        )


def test_key_norms_errors():
    with pytest.raises(TypeError, match="keys must be float16"):
        mlx_knorm.key_norms(mx.array([1, 2]))
    with pytest.raises(ValueError, match="at least one axis"):
        mlx_knorm.key_norms(mx.array(1.0))
    with pytest.raises(TypeError, match="stream must be"):
        mlx_knorm.key_norms(mx.ones((2, 2)), stream="cpu")


@pytest.mark.skipif(_native.ext is None, reason="the native extension is not loaded")
def test_protected_topk_gather_extension_checks_its_own_inputs():
    """The bindings are reachable from Python, so they validate too: no crash."""
    a = good_protected_topk_gather_args()

    def gather(**change):
        return _native.ext.protected_topk_gather(**{**a, "new_norms": mx.zeros((2, 3)), **change})

    with pytest.raises(ValueError, match="keys/values mismatch in N or rows"):
        gather(prior_values=a["prior_values"][:, :2])
    with pytest.raises(ValueError, match="new_norms must be"):
        gather(new_norms=mx.zeros((2, 2)))
    with pytest.raises(TypeError, match="prior_norms must be float32"):
        gather(prior_norms=a["prior_norms"].astype(mx.int32))
    with pytest.raises(ValueError, match="keep must be"):
        gather(keep="up")


@pytest.mark.skipif(_native.ext is None, reason="the native extension is not loaded")
def test_key_norms_extension_checks_its_own_inputs():
    """The binding is reachable from Python, so it validates too: no crash."""
    with pytest.raises(TypeError, match="keys must be"):
        _native.ext.key_norms(mx.zeros((2, 2), mx.int8))


def test_failed_update_leaves_state_untouched():
    state = mlx_knorm.init_knorm_state(1, 4, 8)
    state = mlx_knorm.knorm_update(state, mx.ones((3, 8)), mx.ones((3, 8)))
    before = {f: mx.array(getattr(state, f)) for f in ("keys", "values", "norms")}
    with pytest.raises(ValueError, match="keys/values mismatch in N or rows"):
        mlx_knorm.knorm_update(state, mx.ones((2, 8)), mx.ones((3, 8)))
    with pytest.raises(ValueError, match="prior vs new mismatch"):
        mlx_knorm.knorm_update(state, mx.ones((2, 4)), mx.ones((2, 4)))
    with pytest.raises(TypeError, match="new_keys must be float16"):
        mlx_knorm.knorm_update(state, mx.ones((2, 8), mx.int32), mx.ones((2, 8)))
    for field, value in before.items():
        assert mx.array_equal(getattr(state, field), value).item()
    assert state.keys.shape == (3, 8)


def test_knorm_update_rejects_a_broken_state():
    state = mlx_knorm.init_knorm_state(1, 4, 8)
    broken = mlx_knorm.KnormState(None, None, None, n_sink=5, budget=4, recent=0, keep="low")
    with pytest.raises(ValueError, match="must be < budget"):
        mlx_knorm.knorm_update(broken, mx.ones((2, 8)), mx.ones((2, 8)))
    with pytest.raises(TypeError, match="state must be a KnormState"):
        mlx_knorm.knorm_update((state,), mx.ones((2, 8)), mx.ones((2, 8)))


# evict_and_fill: every error of docs/spec.md §6 for the op, from the Python
# checks on every backend and from the primitive's own checks.


def good_evict_and_fill_args(n=2, slots=6, s=1, d=8, dtype=mx.float16):
    return dict(
        keys=mx.zeros((n, slots, d), dtype),
        values=mx.zeros((n, slots, 3), mx.float32),
        norms=mx.zeros((n, slots)),
        positions=mx.zeros((n, slots), mx.int32),
        new_keys=mx.ones((n, s, d), dtype),
        new_values=mx.ones((n, s, 3), mx.float32),
        filled=6,
        offset=6,
        capacity=6,
        budget=5,
        n_sink=1,
        recent=1,
        keep="low",
        layout="slots",
    )


EVICT_AND_FILL_VALUE_ERRORS = [
    (dict(values=mx.zeros((2, 5, 3))), "keys/values mismatch in N or rows: keys [2, 6, 8] vs values [2, 5, 3]"),
    (dict(new_values=mx.ones((2, 2, 3))), "keys/values mismatch in N or rows"),
    (dict(new_keys=mx.ones((3, 1, 8), mx.float16), new_values=mx.ones((3, 1, 3))),
     "buffers vs new rows mismatch in N or D"),
    (dict(new_keys=mx.ones((2, 1, 4), mx.float16)), "buffers vs new rows mismatch in N or D: keys [2, 6, 8]"),
    (dict(new_values=mx.ones((2, 1, 5))), "buffers vs new rows mismatch in N or D: values [2, 6, 3]"),
    (dict(norms=mx.zeros((2, 5))), "norms must be [N, C]"),
    (dict(positions=mx.zeros((2, 7), mx.int32)), "positions must be [N, C]"),
    (dict(norms=mx.zeros((2, 6, 1))), "norms must have rank 2"),
    (dict(positions=mx.zeros((12,), mx.int32)), "positions must have rank 2"),
    (dict(keys=mx.zeros((2, 6), mx.float16)), "keys must be [..., C, D_k] with at least one head axis"),
    (dict(keys=mx.zeros((1, 2, 6, 8), mx.float16)), "values must have rank 4"),
    (dict(new_values=mx.ones((2, 3))), "new_values must have rank 3"),
    (dict(filled=7), "filled (7) must be <= C, the buffers' slots (6)"),
    (dict(filled=-1), "filled must be >= 0"),
    (dict(offset=-1), "offset must be >= 0"),
    (dict(offset=2**31 - 1), "offset + S (2147483648) must be < 2**31"),
    (dict(capacity=5), "capacity (5) must be >= kept + S (6)"),
    (dict(capacity=2**31), "capacity must be < 2**31"),
    (dict(layout="rows"), "layout must be 'slots' or 'temporal'"),
    (dict(budget=0), "budget must be >= 1"),
    (dict(n_sink=-1), "n_sink must be >= 0"),
    (dict(recent=-2), "recent must be >= 0"),
    (dict(n_sink=3, recent=2), "must be < budget"),
    (dict(keep="middle"), "keep must be 'low' or 'high'"),
    (dict(new_keys=(mx.ones((2, 1, 8), mx.float16),)),
     "new_keys must have the structure of keys: keys is an array, new_keys a tuple of 1 arrays"),
    (dict(values=(mx.zeros((2, 6, 3)), mx.zeros((2, 6, 1))), new_values=mx.ones((2, 1, 3))),
     "new_values must have the structure of values: values is a tuple of 2 arrays, new_values an array"),
    (dict(keys=tuple(mx.zeros((2, 6, 8), mx.float16) for _ in range(4)),
          values=tuple(mx.zeros((2, 6, 3)) for _ in range(3)),
          new_keys=tuple(mx.ones((2, 1, 8), mx.float16) for _ in range(4)),
          new_values=tuple(mx.ones((2, 1, 3)) for _ in range(3))),
     "keys and values take at most 6 payload arrays together, got 7"),
    (dict(values=(mx.zeros((2, 6, 3)), mx.zeros((2, 5, 2))),
          new_values=(mx.ones((2, 1, 3)), mx.ones((2, 1, 2)))),
     "keys/values[1] mismatch in N or rows: keys [2, 6, 8] vs values[1] [2, 5, 2]"),
    (dict(values=(mx.zeros((2, 6, 3)), mx.zeros((2, 6, 2))),
          new_values=(mx.ones((2, 1, 3)), mx.ones((2, 1, 4)))),
     "buffers vs new rows mismatch in N or D: values[1] [2, 6, 2] vs new_values[1] [2, 1, 4]"),
    (dict(new_norms=mx.zeros((2, 2))), "new_norms must be [N, S]: new_norms [2, 2] vs new_keys [2, 1, 8]"),
    (dict(new_norms=mx.zeros((2, 1, 1))), "new_norms must have rank 2"),
    (dict(valid=mx.zeros((2, 3), mx.int32)), "valid must be [N, 2]: valid [2, 3] vs keys [2, 6, 8]"),
    (dict(valid=mx.zeros((3, 2), mx.int32)), "valid must be [N, 2]"),
    (dict(valid=mx.zeros((2,), mx.int32)), "valid must have rank 2"),
    ({**good_evict_and_fill_args(n=0), "values": mx.zeros((0, 6, 2**28), mx.float64),
      "new_values": mx.zeros((0, 1, 2**28), mx.float64)},
     "values has rows of 2147483648 bytes; rows must be < 2**31 bytes, got shape [0, 6, 268435456]"),
    ({**good_evict_and_fill_args(n=0), "values": (mx.zeros((0, 6, 3)), mx.zeros((0, 6, 2**31 - 1), mx.uint8),
                                   mx.zeros((0, 6, 2**30), mx.int16)),
      "new_values": (mx.zeros((0, 1, 3)), mx.zeros((0, 1, 2**31 - 1), mx.uint8),
                     mx.zeros((0, 1, 2**30), mx.int16))},
     "values[2] has rows of 2147483648 bytes"),
]
EVICT_AND_FILL_DTYPE_ERRORS = [
    (dict(positions=mx.zeros((2, 6))), "positions must be int32, got float32"),
    (dict(norms=mx.zeros((2, 6), mx.float16)), "norms must be float32, got float16"),
    (dict(keys=mx.zeros((2, 6, 8), mx.int32)), "keys must be float16, bfloat16 or float32"),
    (dict(new_values=mx.ones((2, 1, 3), mx.int8)), "new_values dtype int8 must equal values dtype float32"),
    (dict(keys=(mx.zeros((2, 6, 8), mx.float16),), new_keys=(mx.ones((2, 1, 8), mx.float16),)),
     "new_norms is required when keys is a tuple"),
    (dict(keys=mx.zeros((2, 6, 8), mx.uint32), new_keys=mx.ones((2, 1, 8), mx.uint32)),
     "keys must be float16, bfloat16 or float32, got uint32"),
    (dict(new_norms=mx.zeros((2, 1), mx.float16)), "new_norms must be float32, got float16"),
    (dict(valid=mx.zeros((2, 2))), "valid must be int32, got float32"),
    (dict(values=(mx.zeros((2, 6, 3)), mx.zeros((2, 6, 2), mx.uint32)),
          new_values=(mx.ones((2, 1, 3)), mx.ones((2, 1, 2), mx.int32))),
     "new_values[1] dtype int32 must equal values[1] dtype uint32"),
    (dict(new_keys=mx.ones((2, 1, 8))), "new_keys dtype float32 must equal keys dtype float16"),
    (dict(new_values=mx.ones((2, 1, 3), mx.bfloat16)), "new_values dtype bfloat16 must equal values dtype float32"),
]
EVICT_AND_FILL_TYPE_ERRORS = EVICT_AND_FILL_DTYPE_ERRORS + [
    (dict(filled=6.0), "filled must be an int, got float"),
    (dict(offset=None), "offset must be an int, got NoneType"),
    (dict(capacity=np.array(6)), "capacity must be an int, got ndarray"),
    (dict(budget=True), "budget must be an int, got bool"),
    (dict(layout=None), "layout must be a str, got NoneType"),
    (dict(keys=None), "keys must be an mlx.core.array, got NoneType"),
    (dict(positions=[[0] * 6] * 2), "positions must be an mlx.core.array, got list"),
    (dict(keys=()), "keys must be an mlx.core.array or a non-empty tuple of them"),
    (dict(values=(mx.zeros((2, 6, 3)), None), new_values=(mx.ones((2, 1, 3)), mx.ones((2, 1, 3)))),
     "values[1] must be an mlx.core.array, got NoneType"),
    (dict(new_norms=[[0.0]] * 2), "new_norms must be an mlx.core.array, got list"),
    (dict(valid=(0, 1)), "valid must be an mlx.core.array, got tuple"),
]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("change, fragment", EVICT_AND_FILL_VALUE_ERRORS)
def test_evict_and_fill_value_errors(backend, change, fragment):
    with mlx_knorm.use_backend(backend), pytest.raises(ValueError, match=re.escape(fragment)):
        mlx_knorm.evict_and_fill(**{**good_evict_and_fill_args(), **change})


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("change, fragment", EVICT_AND_FILL_TYPE_ERRORS)
def test_evict_and_fill_type_errors(backend, change, fragment):
    with mlx_knorm.use_backend(backend), pytest.raises(TypeError, match=re.escape(fragment)):
        mlx_knorm.evict_and_fill(**{**good_evict_and_fill_args(), **change})


@pytest.mark.skipif(_native.ext is None, reason="the native extension is not loaded")
@pytest.mark.parametrize(
    "change, fragment, error",
    [(c, f, ValueError) for c, f in EVICT_AND_FILL_VALUE_ERRORS] + [(c, f, TypeError) for c, f in EVICT_AND_FILL_DTYPE_ERRORS],
)
def test_evict_and_fill_primitive_checks_its_own_inputs(change, fragment, error):
    """The binding is reachable from Python and shapeless compilation skips
    the Python checks: the primitive raises the same errors itself."""
    args = {**good_evict_and_fill_args(), **change}
    with pytest.raises(error, match=re.escape(fragment)):
        mx.eval(_native.ext.evict_and_fill(**args))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_evict_and_fill_failure_leaves_buffers_untouched(backend):
    args = good_evict_and_fill_args()
    args["keys"] = mx.arange(2 * 6 * 8, dtype=mx.float16).reshape(2, 6, 8)
    before = np.array(args["keys"])
    with mlx_knorm.use_backend(backend), pytest.raises(ValueError):
        mlx_knorm.evict_and_fill(**{**args, "capacity": 3})
    assert np.array_equal(before, np.array(args["keys"]))


# The fallback refuses what the primitives refuse, also where a caller ran
# its own checks and skips the op's Python checks (the state API, the cache).


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize(
    "change, fragment, error",
    [(c, f, ValueError) for c, f in EVICT_AND_FILL_VALUE_ERRORS] + [(c, f, TypeError) for c, f in EVICT_AND_FILL_DTYPE_ERRORS],
)
def test_unchecked_evict_and_fill_refuses_what_the_primitive_refuses(backend, change, fragment, error):
    args = {**good_evict_and_fill_args(), **change}
    with mlx_knorm.use_backend(backend), pytest.raises(error, match=re.escape(fragment)):
        mx.eval(evict_and_fill_unchecked(**args))


UNCHECKED_PROTECTED_TOPK_GATHER_ERRORS = [
    (dict(new_values=mx.ones((2, 4, 8), mx.float16)), ValueError, "keys/values mismatch in N or rows"),
    (dict(prior_values=mx.ones((2, 5, 7), mx.float16)), ValueError, "prior vs new mismatch in N or D"),
    (dict(prior_norms=mx.zeros((2, 4))), ValueError, "prior_norms must be [N, n_prior]"),
    (dict(new_norms=mx.zeros((2, 2))), ValueError, "new_norms must be [N, S]"),
    (dict(budget=0), ValueError, "budget must be >= 1"),
    (dict(n_sink=3, recent=3), ValueError, "must be < budget"),
    (dict(keep="middle"), ValueError, "keep must be 'low' or 'high'"),
    (dict(new_keys=mx.ones((2, 3, 8), mx.int32)), TypeError, "new_keys must be float16, bfloat16 or float32"),
    (dict(prior_norms=mx.zeros((2, 5), mx.float16)), TypeError, "prior_norms must be float32"),
]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("change, error, fragment", UNCHECKED_PROTECTED_TOPK_GATHER_ERRORS)
def test_unchecked_protected_topk_gather_refuses_what_the_primitive_refuses(backend, change, error, fragment):
    args = {**good_protected_topk_gather_args(), "new_norms": mx.zeros((2, 3)), **change}
    order = ("prior_keys", "prior_values", "prior_norms", "new_keys", "new_values", "new_norms",
             "budget", "n_sink", "recent", "keep")
    with mlx_knorm.use_backend(backend), pytest.raises(error, match=re.escape(fragment)):
        mx.eval(protected_topk_gather_unchecked(*(args[name] for name in order)))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_unchecked_key_norms_refuses_what_the_primitive_refuses(backend):
    with mlx_knorm.use_backend(backend), pytest.raises(TypeError, match="keys must be float16"):
        mx.eval(key_norms_unchecked(mx.zeros((2, 8), mx.int32)))


@requires_emulator
def test_key_norms_metal_width_limit_names_the_argument():
    with mlx_knorm.use_backend("metal-emulator"):
        with pytest.raises(ValueError, match=r"keys: the Metal key-norm kernel supports D <= 512, got D = 513"):
            mlx_knorm.key_norms(mx.zeros((2, 513)))


@requires_emulator
def test_evict_and_fill_metal_width_limit_names_the_argument():
    with mlx_knorm.use_backend("metal-emulator"):
        with pytest.raises(ValueError, match=r"new_keys: the Metal key-norm kernel supports D <= 512, got D = 513"):
            mlx_knorm.evict_and_fill(**{**good_evict_and_fill_args(), "keys": mx.zeros((2, 6, 513), mx.float16),
                                        "new_keys": mx.ones((2, 1, 513), mx.float16)})


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("rows", [1, 6])
@pytest.mark.parametrize("op", ["evict_and_fill", "protected_topk_gather", "key_norms"])
def test_inputs_that_are_slices_of_larger_buffers(op, backend, rows):
    """Evaluated views that are not row-contiguous (what a cache's state
    gives, sliced from its buffers) are valid inputs on every backend and
    give what their copies give (mx.as_strided, which pins the fallbacks'
    shapes, refuses some such views)."""
    rng = np.random.default_rng(3)
    whole = [mx.array(rng.standard_normal(shape).astype(np.float32)) for shape in ((2, 9, 8), (2, 9, 3), (2, 9))]
    whole.append(mx.array(np.stack([rng.permutation(9) for _ in range(2)]).astype(np.int32)))
    mx.eval(whole)
    views = [w[:, :rows] for w in whole]
    mx.eval(views)
    copies = [mx.array(np.array(v)) for v in views]
    config = dict(filled=rows, offset=9, capacity=rows, budget=5, n_sink=1, recent=1, keep="low", layout="slots")
    new = [mx.ones((2, 1, 8)), mx.ones((2, 1, 3))]
    with mlx_knorm.use_backend(backend):
        if op == "evict_and_fill":
            for got, want in zip(mlx_knorm.evict_and_fill(*views, *new, **{**config, "capacity": rows + 1}),
                                 mlx_knorm.evict_and_fill(*copies, *new, **{**config, "capacity": rows + 1})):
                assert mx.array_equal(got[:, : min(rows, 5) + 1], want[:, : min(rows, 5) + 1]).item()
        elif op == "protected_topk_gather":
            got = mlx_knorm.protected_topk_gather(*views[:3], *new, mx.ones((2, 1)), 5, 1, 1, "low")
            want = mlx_knorm.protected_topk_gather(*copies[:3], *new, mx.ones((2, 1)), 5, 1, 1, "low")
            assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))
        else:
            assert mx.array_equal(mlx_knorm.key_norms(views[2]), mlx_knorm.key_norms(copies[2])).item()

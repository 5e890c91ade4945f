"""The benchmark's cases: one ``knorm_update_batched`` step each, with its
inputs, what a user would pick instead (the reference), and the arrays whose
copy is the memory floor."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..ops.key_norms import fallback as fallback_key_norms
from ..validation import FLOAT_DTYPES

IMPLEMENTATIONS = ("kernel", "fallback", "reference")
N_SINK = 4

# The steps the speed targets are set for, (budget, S): the quick suite.
TARGET_STEPS = [(512, 1), (2048, 1), (512, 4096), (2048, 8192)]


@dataclass(frozen=True)
class Case:
    """One step: ``n_prior`` cached rows plus ``n_new`` new rows per head."""

    kind: str  # "decode" (S = 1 from a full cache) or "prefill" (empty cache)
    n_rows: int
    dim: int
    budget: int
    n_prior: int
    n_new: int
    dtype: str

    @property
    def label(self) -> str:
        return f"{self.kind} S={self.n_new} budget={self.budget}"

    @property
    def kept(self) -> int:
        return min(self.n_prior + self.n_new, self.budget)


def make_case(budget: int, n_new: int, n_rows: int, dim: int, dtype: str) -> Case:
    """S = 1 is a decode step from a full cache; S > 1 a prefill into an empty one."""
    if n_new == 1:
        return Case("decode", n_rows, dim, budget, budget, 1, dtype)
    return Case("prefill", n_rows, dim, budget, 0, n_new, dtype)


def suite(steps, n_rows: int, dim: int, dtype: str) -> list[Case]:
    """One case per (budget, S) of ``steps``."""
    return [make_case(b, s, n_rows, dim, dtype) for b, s in steps]


def random_arrays(shapes, dtype: mx.Dtype, seed: int) -> list[mx.array]:
    """Standard normal arrays of ``shapes`` in ``dtype``, one key of ``seed`` each."""
    keys = mx.random.split(mx.random.key(seed), len(shapes))
    return [mx.random.normal(shape, key=k).astype(dtype) for shape, k in zip(shapes, keys)]


def case_inputs(case: Case, seed: int = 0):
    """Evaluated ``(prior_keys, prior_values, prior_norms, new_keys, new_values)``."""
    prior_shape = (case.n_rows, case.n_prior, case.dim)
    new_shape = (case.n_rows, case.n_new, case.dim)
    prior_keys, prior_values, new_keys, new_values = random_arrays(
        [prior_shape, prior_shape, new_shape, new_shape], FLOAT_DTYPES[case.dtype], seed
    )
    inputs = (prior_keys, prior_values, fallback_key_norms(prior_keys), new_keys, new_values)
    mx.eval(inputs)
    return inputs


def step_arguments(case: Case, inputs):
    return (*inputs, case.budget, N_SINK, 0, "low")


def output_copies(case: Case):
    """Arrays shaped like the op's outputs; copying them is the memcpy floor."""
    dtype = FLOAT_DTYPES[case.dtype]
    outputs = (
        mx.zeros((case.n_rows, case.kept, case.dim), dtype=dtype),
        mx.zeros((case.n_rows, case.kept, case.dim), dtype=dtype),
        mx.zeros((case.n_rows, case.kept), dtype=mx.float32),
        mx.zeros((case.n_rows, case.kept), dtype=mx.uint32),
    )
    mx.eval(outputs)
    return outputs


def reference_update():
    """The reference's ``knorm_update_batched``, or None when not installed."""
    try:
        from veloxquant_mlx.quantizers.knorm import knorm_update_batched as reference
    except ImportError:
        return None
    return reference

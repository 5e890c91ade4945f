"""The order keys both selecting ops rank by (docs/spec.md §3, §4), as the
kernels compute them (csrc/common/selection.h, metal/knorm_defines.h)."""

from __future__ import annotations

import mlx.core as mx

_SIGN = 0x80000000
# Every NaN score's key (kNanScoreKey): after every number's, below a
# padding row's.
NAN_SCORE_KEY = 0xFFFFFFFE
# A padding row's score key (kPaddingScoreKey): after every score key, NaN's
# included (docs/spec.md §4 step 1).
PADDING_SCORE_KEY = 0xFFFFFFFF


def score_order_key(score: mx.array) -> mx.array:
    """Order-preserving uint32 image of float32 scores: -0 and +0 together,
    every NaN after +inf."""
    bits = score.view(mx.uint32)
    bits = mx.where((bits & 0x7FFFFFFF) == 0, mx.array(0, mx.uint32), bits)
    key = mx.where(bits >= _SIGN, ~bits, bits | _SIGN)
    return mx.where(mx.isnan(score), mx.array(NAN_SCORE_KEY, mx.uint32), key)


def position_order_key(positions: mx.array) -> mx.array:
    """int32 positions as uint32 in the same order (the sign bit flipped)."""
    return positions.view(mx.uint32) ^ _SIGN

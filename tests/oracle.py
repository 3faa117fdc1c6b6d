"""The token-identity oracle (DESIGN.md): greedy tokens must equal the reference wherever the
reference's top-2 logit margin is clear; after a near-tie the sequences may legitimately diverge."""

from __future__ import annotations

NEAR_TIE = 1e-3


def compare_greedy(got: list[int], ref: list[int], margins: list[float], near_tie: float = NEAR_TIE) -> bool:
    """Assert `got` matches `ref`; return True when a near-tie divergence ended the comparison early."""
    assert len(got) == len(ref), f"length {len(got)} != reference {len(ref)}"
    for i, (g, r) in enumerate(zip(got, ref)):
        if g != r:
            assert margins[i] < near_tie, (
                f"token {i}: got {g}, reference {r} with a clear margin {margins[i]:.4g}\n got={got}\n ref={ref}")
            return True
    return False

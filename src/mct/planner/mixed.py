"""Depth extrapolation of a mixed stack (``checkpointing.per_block``): which shallow
copies stand for it (``mct.planner.depth`` runs and extends them).

A mixed stack repeats within each run of blocks with one choice (e.g. 8 'all', then 8
'selective', then 16 'none'), not as a whole. Its copies keep every run, a run of 5 or
more blocks cut to ``CUT`` (its first, a middle and its last block: the blocks next to a
run's ends see a neighbour of another kind). One copy has every run so; for each cut run
one more copy has that run one block longer. Every number of the full model is
``A + sum_g m_g (B_g - A)`` (``m_g``: the blocks run g has beyond ``CUT``): the bytes of a
window are a sum over blocks, so each run's blocks add their own share, whatever the
other runs hold (tested against full dry runs, to the byte).
"""

from __future__ import annotations

from dataclasses import dataclass


CUT = 3
"""Blocks a cut run of a mixed stack keeps in the smaller copy: its first, a middle and its last."""


@dataclass(frozen=True)
class MixedShape:
    """How a mixed stack's dry run is extrapolated (module docstring): ``runs``, each
    run's choice and length in block order; ``grown``, the runs that are cut to ``CUT``
    blocks (the others are whole in every copy)."""

    runs: tuple[tuple[str, int], ...]
    grown: tuple[int, ...]

    def lengths(self, longer: int | None = None) -> list[int]:
        """Each run's length in the smaller copy, or with run ``longer`` one block longer."""
        return [(CUT if g in self.grown else n) + (g == longer) for g, (_, n) in enumerate(self.runs)]

    def choices(self, longer: int | None = None) -> list[str]:
        return [c for (c, _), n in zip(self.runs, self.lengths(longer)) for _ in range(n)]

    @property
    def blocks(self) -> int:
        """Blocks the copies' dry runs step through, together."""
        return (len(self.grown) + 1) * sum(self.lengths()) + len(self.grown)

    def mapped(self, k: int | str, g: int) -> list[int | str]:
        """The blocks of the copy with run ``g`` longer whose windows continue block
        ``k``'s of the smaller copy: the same block, one place later behind run ``g``; in
        run ``g`` itself as ``depth._mapped`` with a period of one."""
        if k == "head":
            return [k]
        assert isinstance(k, int)
        start = sum(self.lengths()[:g])
        if k < start:
            return [k]
        if k >= start + CUT:
            return [k + 1]
        q = k - start
        return ([k] if q < 2 else []) + ([k + 1] if q >= 1 else [])


def mixed_shape(n: int, choices: list[str], cheaper_only: bool = True) -> MixedShape | None:
    """The copies of a stack of ``n`` blocks with per-block ``choices``, or None when no run
    is long enough to cut (5 blocks) or, with ``cheaper_only``, the copies hold no fewer
    blocks than the model."""
    runs: list[tuple[str, int]] = []
    for c in choices:
        if runs and runs[-1][0] == c:
            runs[-1] = (c, runs[-1][1] + 1)
        else:
            runs.append((c, 1))
    grown = tuple(g for g, (_, length) in enumerate(runs) if length - CUT >= 2)
    shape = MixedShape(tuple(runs), grown)
    return shape if grown and (shape.blocks < n or not cheaper_only) else None

"""SampleAttention's artifact: sequence-length bucket -> (alpha_c, alpha_s, chunk_n) (paper Table 6 shape).

``edges = [e_0 < e_1 < ... < e_{n-1}]`` cut lengths into ``n + 1`` buckets: ``[0, e_0)``,
``[e_0, e_1)``, ..., ``[e_{n-1}, inf)`` (the paper's ``<16K, [16K,48K), ..., >=112K``); bucket ``i``
uses ``rows[i]``. A length equal to an edge belongs to the bucket that starts there.
``max_length`` is the longest prompt length the table was tuned on (the upper end of the last bucket
as profiled); longer prompts still use the last row, and the first such lookup logs one warning line.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BucketRow:
    """Parameters of one length bucket."""

    alpha_c: float  # column CRA threshold in (0, 1]; 1 = dense
    alpha_s: float  # slash CRA threshold in (0, 1]; 1 = dense
    chunk_n: int  # number of sampled query slices

    def __post_init__(self) -> None:
        for name in ("alpha_c", "alpha_s"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"bucket row {name}={value} is outside (0, 1]; use e.g. 0.95 (1.0 = dense)")
        if isinstance(self.chunk_n, bool) or not isinstance(self.chunk_n, int) or self.chunk_n < 1:
            raise ValueError(f"bucket row chunk_n={self.chunk_n!r} must be an integer >= 1")

    @property
    def dense(self) -> bool:
        """True when the row short-circuits to dense attention (either alpha is 1)."""
        return self.alpha_c >= 1.0 or self.alpha_s >= 1.0


@dataclass
class BucketTable:
    """Length buckets and their rows; ``len(rows) == len(edges) + 1``; ``blk`` is the block size."""

    edges: list[int]
    rows: list[BucketRow]
    blk: int = 64
    max_length: int | None = None
    _warned_beyond: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.edges = [int(e) for e in self.edges]
        if any(e <= 0 for e in self.edges) or any(a >= b for a, b in zip(self.edges, self.edges[1:])):
            raise ValueError(f"bucket edges {self.edges} must be positive and strictly increasing")
        if len(self.rows) != len(self.edges) + 1:
            raise ValueError(f"{len(self.edges)} bucket edges need {len(self.edges) + 1} rows, got {len(self.rows)}")
        if self.blk < 1:
            raise ValueError(f"blk={self.blk} must be >= 1")
        if self.max_length is not None and self.max_length < 1:
            raise ValueError(f"max_length={self.max_length} must be >= 1 (or None: no upper end)")

    def bucket_index(self, length: int) -> int:
        """Index of the bucket holding ``length`` (edges are inclusive lower bounds)."""
        if length < 1:
            raise ValueError(f"sequence length {length} must be >= 1")
        return bisect.bisect_right(self.edges, length)

    def lookup(self, length: int) -> BucketRow:
        """The row for a prompt of ``length`` tokens; beyond ``max_length`` the last row (logged once)."""
        index = self.bucket_index(length)
        if self.max_length is not None and length > self.max_length and not self._warned_beyond:
            self._warned_beyond = True
            logger.warning(
                "SampleAttention: prompt length %d exceeds the longest tuned length %d; using the last "
                "bucket's parameters %s (logged once)", length, self.max_length, self.rows[-1],
            )
        return self.rows[index]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form stored in the artifact manifest."""
        return {
            "edges": list(self.edges),
            "rows": [{"alpha_c": r.alpha_c, "alpha_s": r.alpha_s, "chunk_n": r.chunk_n} for r in self.rows],
            "blk": self.blk,
            "max_length": self.max_length,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "BucketTable":
        """Inverse of :meth:`to_dict`; raises ``ValueError`` naming what is missing or wrong."""
        missing = {"edges", "rows"} - set(data)
        if missing:
            raise ValueError(f"SampleAttention bucket table lacks {sorted(missing)}; re-run the calibration")
        try:
            rows = [BucketRow(float(r["alpha_c"]), float(r["alpha_s"]), int(r["chunk_n"])) for r in data["rows"]]
        except (KeyError, TypeError) as err:
            raise ValueError(f"malformed SampleAttention bucket row ({err!r}); each row needs "
                             f"alpha_c, alpha_s, chunk_n") from err
        return cls(list(data["edges"]), rows, int(data.get("blk", 64)), data.get("max_length"))

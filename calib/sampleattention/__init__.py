"""SampleAttention calibration (docs/methods.md): per length bucket, search (alpha_c, alpha_s, chunk_n)."""

from calib.sampleattention.tuning import (
    EvaluatedPoint,
    GridPoint,
    PointResult,
    SkippedPoint,
    TuningResult,
    build_bucket_table,
    choose_point,
    lengths_by_bucket,
    tune_length_bucket,
)

__all__ = [
    "EvaluatedPoint",
    "GridPoint",
    "PointResult",
    "SkippedPoint",
    "TuningResult",
    "build_bucket_table",
    "choose_point",
    "lengths_by_bucket",
    "tune_length_bucket",
]

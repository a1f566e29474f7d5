"""SALE calibration: per (layer, query head) threshold tau by tau-halving (docs/methods.md, SALE)."""

from calib.sale.halving import HalvingResult, HalvingStep, halve_thresholds, head_errors, sale_errors_fn

__all__ = ["HalvingResult", "HalvingStep", "halve_thresholds", "head_errors", "sale_errors_fn"]

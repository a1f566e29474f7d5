"""calib: offline calibration, training and registry for SAAP, SALE, SampleAttention and SANTA.

The runtime that consumes calib's artifacts lives in the separate package ``runtime_kernels``;
dependencies point one way (calib -> runtime_kernels).
"""

__version__ = "0.1.0"

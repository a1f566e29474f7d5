"""`import runtime_kernels` (and every submodule) pulls in nothing of the calibration stack: neither hydra,
mlflow nor calib, nor faiss, scikit-learn, matplotlib or datasets (calib-runtime declares none of them)."""

from __future__ import annotations

import subprocess
import sys

CODE = r"""
import importlib, pkgutil, sys
import runtime_kernels
names = [m.name for m in pkgutil.walk_packages(runtime_kernels.__path__, "runtime_kernels.")]
for name in names:
    if "triton" in name.rsplit(".", 1)[-1]:
        continue  # GPU kernels and their helpers import triton; checked on the GPU box
    importlib.import_module(name)
stack = {"hydra", "omegaconf", "mlflow", "calib", "faiss", "sklearn", "matplotlib", "datasets"}
bad = sorted(m for m in sys.modules if m.split(".")[0] in stack)
print(len(names), ",".join(bad))
"""


def test_runtime_kernels_imports_no_hydra_mlflow_or_calib():
    proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    count, bad = proc.stdout.strip().split(" ", 1) if " " in proc.stdout.strip() else (proc.stdout.strip(), "")
    assert int(count) >= 3  # manifest, artifact, blocksparse at least
    assert bad == "", f"runtime_kernels imported {bad}"

"""runtime_kernels: what inference needs from a calib artifact.

Independent of calib: importing this package never imports hydra, mlflow or calib (a subprocess
test holds this). One folder per method, each with ``reference.py`` (plain PyTorch, the definition
of correct) and, where it exists, ``triton.py`` (GPU kernels with the same signature).
"""

__version__ = "0.1.0"

#!/usr/bin/env bash
# Wheels that let `python -m calib ...` run on a GPU box with no network whose image already holds
# torch, transformers, numpy, scikit-learn, matplotlib, pandas, requests, pyyaml, click, protobuf
# (as the project's GPU images do): Hydra, OmegaConf and MLflow's tracking client
# with its SQLite store, nothing of MLflow's server. Faiss is not included: SAAP's k-means falls back
# to its torch implementation (method.kmeans.backend=auto).
#
#   scripts/offline_wheels.sh [DIR] [PYTHON_VERSION]      # default: .whl 3.12 (ignored by git)
#   # on the box, from the repository root:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site DIR/*.whl
#   export PYTHONPATH=/tmp/site
#
# The list is what the CPU test suite needed, found by running it in a virtualenv holding only the
# image's packages: 33 MB for Python 3.12.
set -euo pipefail
dir=${1:-.whl}
py=${2:-3.12}
mkdir -p "$dir"
pure=(
  hydra-core==1.3.8 omegaconf==2.3.1
  mlflow==3.17.2 mlflow-skinny==3.17.2 mlflow-tracing==3.17.2 alembic==1.20.1 mako==1.4.3 sqlparse==0.6.1
  pydantic==2.14.3 annotated-types==0.8.0 typing-inspection==0.4.5
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
  opentelemetry-proto==1.45.2
  fastapi==0.165.0 starlette==1.10.0 databricks-sdk==0.156.0 cachetools==7.3.2 importlib-metadata==9.1.0
  pycparser==3.12
)
binary=(sqlalchemy==2.1.9 pydantic-core==2.50.4 cryptography==50.0.2 cffi==2.1.1)
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform any)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
  "${platforms[@]}" -d "$dir" "${pure[@]}" "${binary[@]}"
# antlr4-python3-runtime (OmegaConf's parser) is published as a source archive only: build its pure wheel
python3 -m pip wheel -q --no-deps -w "$dir" antlr4-python3-runtime==4.9.3
du -sh "$dir"

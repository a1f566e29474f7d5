"""What an inference user does with only ``calib-runtime`` installed; run by test_runtime_install.py in a
fresh virtual environment (standalone: it imports nothing from the repository).

``python runtime_user.py MODEL_DIR ARTIFACT [TRACKING_URI]`` loads the model with transformers, decodes a
few greedy steps densely, then with ``runtime_kernels.hf.apply(model, ARTIFACT)`` (a SAAP artifact directory
or ``models:/`` URI; every bucket visited, and one bucket), tries a ``models:/`` URI when mlflow is not
installed, and prints one JSON object of what it saw.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import sys

import torch

STEPS = 4
PROMPT = 40


def decode_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Greedy decode ``STEPS`` tokens after the prompt ``ids: [B, T]``; the steps' logits ``[B, STEPS, V]``."""
    from runtime_kernels.generate import cache_argument, output_cache  # the installed package's

    out = model(ids, use_cache=True)
    past, tok, logits = output_cache(out), out.logits[:, -1:].argmax(-1), []
    for _ in range(STEPS):
        out = model(tok, use_cache=True, **{cache_argument(model): past})
        past, tok = output_cache(out), out.logits[:, -1:].argmax(-1)
        logits.append(out.logits[:, -1])
    return torch.stack(logits, 1)


@torch.no_grad()
def main(model_dir: str, artifact: str, tracking_uri: str | None) -> dict:
    from transformers import AutoModelForCausalLM

    import runtime_kernels
    from runtime_kernels import hf
    from runtime_kernels.errors import ArtifactError

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.randint(4, model.config.vocab_size, (2, PROMPT), generator=torch.Generator().manual_seed(0))
    dense = decode_logits(model, ids)
    state = hf.apply(model, artifact, tracking_uri=tracking_uri)
    applied = {"decode_runtime": type(state.decode).__name__, "prefill_is_dense": state.prefill is None,
               "artifact_path": str(state.artifacts[0].path)}
    every_bucket = decode_logits(model, ids)
    hf.remove(model)
    hf.apply(model, artifact, tracking_uri=tracking_uri, options={"saap": {"top_l": 1}})
    one_bucket = decode_logits(model, ids)
    hf.remove(model)
    registry_error = None
    if importlib.util.find_spec("mlflow") is None:
        try:
            hf.apply(model, "models:/saap-tiny@candidate")
        except ArtifactError as exc:
            registry_error = str(exc)
    calib_stack = ("hydra", "omegaconf", "mlflow", "calib", "faiss", "sklearn", "matplotlib", "datasets")
    return {
        "runtime_kernels": runtime_kernels.__file__,
        **applied,
        "dense_scale": float(dense.abs().max()),
        "every_bucket_max_diff": float((every_bucket - dense).abs().max()),
        "one_bucket_max_diff": float((one_bucket - dense).abs().max()),
        "registry_error": registry_error,
        "imported": sorted({m.split(".")[0] for m in sys.modules} & set(calib_stack)),
        "importable": sorted(m for m in calib_stack if importlib.util.find_spec(m) is not None),
        "distributions": sorted(d.metadata["Name"].lower() for d in importlib.metadata.distributions()),
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)))

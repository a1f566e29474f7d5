"""What an inference user does with only ``calib-runtime`` installed; run by test_runtime_install.py in a
fresh virtual environment (standalone: it imports nothing from the repository).

``python runtime_user.py MODEL_DIR SAAP_ARTIFACT_DIR`` loads the model with transformers, decodes a few
greedy steps densely, then with ``runtime_kernels.hf.apply(model, artifact)`` (every bucket visited, and
one bucket), tries a ``models:/`` URI without mlflow, and prints one JSON object of what it saw.
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
    out = model(ids, use_cache=True)
    past, tok, logits = out.past_key_values, out.logits[:, -1:].argmax(-1), []
    for _ in range(STEPS):
        out = model(tok, past_key_values=past, use_cache=True)
        past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        logits.append(out.logits[:, -1])
    return torch.stack(logits, 1)


@torch.no_grad()
def main(model_dir: str, artifact_dir: str) -> dict:
    from transformers import AutoModelForCausalLM

    import runtime_kernels
    from runtime_kernels import hf
    from runtime_kernels.errors import ArtifactError

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.randint(4, model.config.vocab_size, (2, PROMPT), generator=torch.Generator().manual_seed(0))
    dense = decode_logits(model, ids)
    state = hf.apply(model, artifact_dir)
    every_bucket = decode_logits(model, ids)
    runtime = type(state.decode).__name__, state.prefill is None
    hf.remove(model)
    hf.apply(model, artifact_dir, options={"saap": {"top_l": 1}})
    one_bucket = decode_logits(model, ids)
    hf.remove(model)
    try:
        hf.apply(model, "models:/saap-tiny@candidate")
        registry_error = None
    except ArtifactError as exc:
        registry_error = str(exc)
    calib_stack = ("hydra", "omegaconf", "mlflow", "calib", "faiss", "sklearn", "matplotlib", "datasets")
    return {
        "runtime_kernels": runtime_kernels.__file__,
        "decode_runtime": runtime[0],
        "prefill_is_dense": runtime[1],
        "dense_scale": float(dense.abs().max()),
        "every_bucket_max_diff": float((every_bucket - dense).abs().max()),
        "one_bucket_max_diff": float((one_bucket - dense).abs().max()),
        "registry_error": registry_error,
        "imported": sorted({m.split(".")[0] for m in sys.modules} & set(calib_stack)),
        "importable": sorted(m for m in calib_stack if importlib.util.find_spec(m) is not None),
        "distributions": sorted(d.metadata["Name"].lower() for d in importlib.metadata.distributions()),
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))

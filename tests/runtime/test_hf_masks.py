"""The mask transformers hands the calib attention function: SDPA's, so unpadded batches stay maskless."""

from __future__ import annotations

import torch

from runtime_kernels import hf

from tests.runtime.small_models import small_llama


class _RecordingPrefill:
    """A prefill method that records each call's mask and batch, and runs dense (returns None)."""

    method = "recording"
    phase = "prefill"

    def __init__(self) -> None:
        self.calls: list[tuple[int, object]] = []

    def prefill(self, layer, q, k, v, scale, ctx):
        self.calls.append((q.shape[0], ctx.attention_mask))
        return None


def test_an_unpadded_batch_reaches_the_prefill_method_without_a_mask():
    """Under SDPA's mask builder an unpadded causal batch has no mask (SDPA's is_causal path). Without it,
    what a custom attention name gets depends on the transformers release: a dense [B, 1, T, T] mask (the
    method then skips every batch of several prompts, and dense SDPA runs its slower masked kernels) or
    no mask at all, even for a padded batch (next test)."""
    model = small_llama()
    rec = _RecordingPrefill()
    hf.attach(model, prefill=rec)
    try:
        ids = torch.randint(0, 300, (3, 40), generator=torch.Generator().manual_seed(0))
        out = model(input_ids=ids).logits
    finally:
        hf.remove(model)
    assert rec.calls and all(b == 3 and mask is None for b, mask in rec.calls)
    torch.testing.assert_close(out, model(input_ids=ids).logits)  # the fallback is the model's own SDPA


def test_a_padded_batch_still_gets_its_mask_and_runs_dense():
    model = small_llama()
    rec = _RecordingPrefill()
    hf.attach(model, prefill=rec)
    try:
        ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1))
        pad = torch.ones_like(ids)
        pad[1, :5] = 0
        out = model(input_ids=ids, attention_mask=pad).logits
    finally:
        hf.remove(model)
    assert not rec.calls  # padded: the method is never asked
    torch.testing.assert_close(out, model(input_ids=ids, attention_mask=pad).logits)

#!/usr/bin/env python
"""Why a model does or does not answer key-value retrieval: a teacher-forced probe by number of pairs.

    python scripts/kv_probe.py --model artifacts/models/tiny            # CPU, ~1 min
    python scripts/kv_probe.py --model /tmp/run --pairs 4,16,64 --prompts 32

For each number of pairs ``n`` it builds ``kv_retrieval`` prompts (seeds of their own, never the
evaluation's), reads the model's next-token distribution right after the answer prefix ``"key": "``,
and reports:

- ``acc``: the argmax is the asked key's value;
- ``copied``: the argmax is *some* value of the JSON (a copy without the key match);
- ``rank``: median rank of the right value among the whole vocabulary (0 = top); a key match puts it
  first, a copy without it puts it among the other ``n - 1`` values, below them it is suppressed.

Then, on one prompt, the lookup's two ingredients per layer-0/1 head: the attention mass a value
token puts on its own key 4 tokens back (``"k": "v"`` is ``" k " : " v``), and the mass the final
position puts on the asked key 3 tokens back. A key match needs both (an induction over a 4-token
offset); when no head has them the model can only copy values at random.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from calib.data.prompt import PromptFormatter  # noqa: E402
from calib.data.synthetic import kv_retrieval  # noqa: E402
from calib.data.vocab import seed_from  # noqa: E402

KEY_TO_VALUE = 4   # value position - key position in `" k " : " v`
PREFIX_TO_KEY = 3  # the prompt's last token `"` - the asked key's position in `" k " : "`


def load(model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager",
                                                 local_files_only=True).eval()
    return model, tok


def prompt(tok, fmt: PromptFormatter, n: int, s: int):
    """(ids, answer id, ids of all values in the JSON, positions of the values)."""
    inst = kv_retrieval(seed_from("kv-probe", n, s), n)
    q = inst.queries[0]
    ids = fmt.encode(fmt.render(inst.context, q.question, q.prefix))
    answer = tok(q.completion, add_special_tokens=False)["input_ids"][0]
    n_ctx = len(fmt.encode(inst.context))
    toks = tok.convert_ids_to_tokens(ids[:n_ctx])
    value_pos = [i for i in range(KEY_TO_VALUE, n_ctx) if toks[i - 1] == '"' and toks[i - 2] == ":"]
    return ids, answer, {ids[i] for i in value_pos}, value_pos


@torch.inference_mode()
def probe(model, tok, pairs: list[int], prompts: int) -> list[dict]:
    fmt = PromptFormatter(tok, chat_template=False)
    rows = []
    for n in pairs:
        right = copied = 0
        ranks = []
        for s in range(prompts):
            ids, answer, values, _ = prompt(tok, fmt, n, s)
            logits = model(torch.tensor([ids])).logits[0, -1]
            top = int(logits.argmax())
            right += top == answer
            copied += top in values
            ranks.append(int((logits > logits[answer]).sum()))
        rows.append({"pairs": n, "tokens": len(ids), "acc": right / prompts, "copied": copied / prompts,
                     "rank": statistics.median(ranks)})
    return rows


@torch.inference_mode()
def lookup_heads(model, tok, n: int, layers: int = 2) -> list[dict]:
    """Per head of the first ``layers`` layers: mean mass from values to their key, and from the final
    position to the asked key."""
    fmt = PromptFormatter(tok, chat_template=False)
    ids, _, _, value_pos = prompt(tok, fmt, n, 0)
    out = model(torch.tensor([ids]), output_attentions=True)
    last = len(ids) - 1
    rows = []
    for layer, att in enumerate(out.attentions[:layers]):
        a = att[0]  # [heads, T, T]
        for h in range(a.shape[0]):
            to_key = a[h, value_pos, [p - KEY_TO_VALUE for p in value_pos]].mean()
            rows.append({"layer": layer, "head": h, "value_to_key": float(to_key),
                         "final_to_asked_key": float(a[h, last, last - PREFIX_TO_KEY])})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "artifacts" / "models" / "tiny")
    ap.add_argument("--pairs", default="4,8,16,32,64,128", help="comma-separated numbers of pairs")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per number of pairs")
    ap.add_argument("--head-pairs", type=int, default=32, help="pairs of the prompt the head table reads")
    args = ap.parse_args(argv)
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"error: --model {args.model}: no config.json there")
    model, tok = load(args.model)
    print(f"{'pairs':>5} {'tokens':>6} {'acc':>5} {'copied':>6} {'rank':>6}")
    for r in probe(model, tok, [int(x) for x in args.pairs.split(",")], args.prompts):
        print(f"{r['pairs']:5d} {r['tokens']:6d} {r['acc']:5.2f} {r['copied']:6.2f} {r['rank']:6.0f}")
    print(f"\nlookup ingredients on a {args.head_pairs}-pair prompt (1/T if uniform):")
    print(f"{'layer':>5} {'head':>4} {'value->key':>10} {'final->key':>10}")
    for r in lookup_heads(model, tok, args.head_pairs):
        print(f"{r['layer']:5d} {r['head']:4d} {r['value_to_key']:10.3f} {r['final_to_asked_key']:10.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python
"""Write the tiny model's tokenizer (tokenizer.json, tokenizer_config.json, special_tokens_map.json).

    python scripts/build_tiny_tokenizer.py [--out artifacts/models/tiny]

The vocabulary is a pure function of calib/data/vocab.py (see calib/data/tokenizer.py), so the files
are byte-identical on every run. scripts/train_tiny.py writes the same files next to the weights.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from calib.data.tokenizer import load_tokenizer, save_tiny_tokenizer  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "artifacts" / "models" / "tiny")
    args = ap.parse_args(argv)
    out = save_tiny_tokenizer(args.out)
    tok = load_tokenizer(out)
    print(f"wrote {out}: vocabulary {len(tok)} tokens (bos={tok.bos_token_id} eos={tok.eos_token_id} "
          f"unk={tok.unk_token_id} pad={tok.pad_token_id})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/bin/bash
# GPU run 46 (session 9): SAAP layer 1 (bmm path) in fewer, wider k steps, B=8 8k / 128k and B=1 128k.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r46; mkdir -p $R
timeout 150 python3 scripts/bench_decode.py --saap-variants default l1-k256 l1-k256-w8 l1-k512-w8 --batches 8 1 --lengths 8192 131072 > $R/saap_l1.txt 2>&1
echo "rc=$?" >> $R/saap_l1.txt; grep -A20 "^SAAP variants" $R/saap_l1.txt
for v in "gemv_block_k=256,gemv_warps=8" "gemv_block_k=512,gemv_warps=8"; do
  SAAP_TRITON_CONFIG="$v" timeout 60 python3 scripts/bench_saap_classifier.py --batch 8 > $R/cls_b8_$v.txt 2>&1; echo "== $v"; grep -E "^(layer1|rank|whole)" $R/cls_b8_$v.txt
done
cd $OUT && tar czf r46.tgz r46 && rm -rf r46

# Session 8, call 3 (issue #15): does the training step's use of the GPU slow the pinning thread's JPEG
# decode? The pipeline alone, and with an emulated graphed step (bf16 matmuls, 40 and 20 ms per batch),
# for the previous decode (old/) and the one with a high-priority stream and pinned copies (this tree);
# then ViT-B-32 training on the shards with this tree.
source setup.sh
echo "start $(date +%T)"
python3 - <<'PY'
import sys, time; sys.path.insert(0, "benchmarks")
from pathlib import Path
from jpeg_data import write_shards
t = time.time(); print(write_shards(Path("/tmp/jpeg/shards"), 16, 1000, 256), round(time.time() - t, 1), "s", flush=True)
PY
mkdir -p $OUT/r
D="--urls /tmp/jpeg/shards/{000000..000015}.tar --samples 16000 --workers 8 --decode gpu --batches 60 --skip 25 --step-ms 40 20"
(cd old && export PYTHONPATH=/tmp/site:$PWD && echo old && timeout 150 python3 benchmarks/data_rate.py $D --out $OUT/r/old.jsonl 2>&1 | grep "^{")
echo new; timeout 150 python3 benchmarks/data_rate.py $D --out $OUT/r/new.jsonl 2>&1 | grep "^{"
mkdir -p /tmp/new8 && ln -sfn /tmp/jpeg/shards /tmp/new8/shards
timeout 130 python3 benchmarks/jpeg_data.py --out /tmp/new8 --shards 16 --per-shard 1000 --gpus 1 --model ViT-B-32 --batch 256 \
  --steps 100 --timeout 100 --workers 8 --sides gpu 2>&1 | grep "^{"
cp /tmp/new8/runs/decode-gpu/metrics.jsonl $OUT/r/new8-decode-gpu-metrics.jsonl; cp /tmp/new8/*.log $OUT/r/
echo "end $(date +%T)"

# Session 8, call 4 (issue #15): the device decode's parts on an idle GPU and on one kept busy by an
# emulated graphed step (42 ms of bf16 matmuls, in a loop on another thread); the pipeline with the
# emulated step at 256 per batch (42 ms) and at 512 per batch (84 ms: the same step time per sample,
# half the decode calls).
source setup.sh
echo "start $(date +%T)"
python3 - <<'PY'
import sys, time; sys.path.insert(0, "benchmarks")
from pathlib import Path
from jpeg_data import write_shards
t = time.time(); print(write_shards(Path("/tmp/jpeg/shards"), 16, 1000, 256), round(time.time() - t, 1), "s", flush=True)
PY
mkdir -p $OUT/r
U="--urls /tmp/jpeg/shards/{000000..000015}.tar --samples 16000 --workers 8 --decode gpu"
timeout 200 python3 benchmarks/data_rate.py $U --batch 256 --batches 60 --skip 25 --step-ms 42 --parts --part-batches 20 --parts-busy-ms 42 --out $OUT/r/b256.jsonl 2>&1 | grep "^{"
timeout 150 python3 benchmarks/data_rate.py $U --batch 512 --batches 30 --skip 12 --step-ms 84 --out $OUT/r/b512.jsonl 2>&1 | grep "^{"
echo "end $(date +%T)"

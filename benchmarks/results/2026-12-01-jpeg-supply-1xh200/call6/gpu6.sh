# Session 8, call 6 (issue #15): data.decode 'mixed' (workers decode with PIL, the device crops and resizes
# in the step's stream) beside 'gpu' and synthetic data, ViT-B-32 training, 8 workers; the CUDA tests of
# tests/test_decode.py first.
source setup.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl-test/*.whl
echo "start $(date +%T)"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_decode.py 2>&1 | tail -3
python3 - <<'PY'
import sys, time; sys.path.insert(0, "benchmarks")
from pathlib import Path
from jpeg_data import write_shards
t = time.time(); print(write_shards(Path("/tmp/jpeg/shards"), 16, 1000, 256), round(time.time() - t, 1), "s", flush=True)
PY
timeout 280 python3 benchmarks/jpeg_data.py --out /tmp/jpeg --shards 16 --per-shard 1000 --gpus 1 --model ViT-B-32 --batch 256 \
  --steps 100 --timeout 85 --workers 8 --sides mixed,gpu,synthetic 2>&1 | grep "^{"
mkdir -p $OUT/j; for f in /tmp/jpeg/*.log /tmp/jpeg/jpeg_data.json; do cp $f $OUT/j/; done; for r in /tmp/jpeg/runs/*; do cp $r/metrics.jsonl $OUT/j/$(basename $r)-metrics.jsonl; done
tar czf $OUT/j.tgz -C $OUT j && rm -rf $OUT/j
echo "end $(date +%T)"

# Session 10, call 1 (issue #15): data.device_decode_share beside 'mixed' and synthetic, ViT-B-32, 1×H200,
# 8 workers, 32 shards (125 batches per epoch), 250 steps; the CUDA tests of tests/test_decode.py first.
source setup.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-test/*.whl 2>&1 | tail -1
echo "start $(date +%T)"
python3 -m pytest -q -p no:cacheprovider tests/test_decode.py 2>&1 | tail -3
python3 - <<'PY'
import sys, time; sys.path.insert(0, "benchmarks")
from pathlib import Path
from jpeg_data import write_shards
t = time.time(); print(write_shards(Path("/tmp/jpeg/shards"), 32, 1000, 256), round(time.time() - t, 1), "s", flush=True)
PY
J="--shards 32 --per-shard 1000 --gpus 1 --model ViT-B-32 --batch 256 --steps 250 --timeout 120 --workers 8"
mkdir -p /tmp/r2 && ln -sf /tmp/jpeg/shards /tmp/r2/shards
echo "== round 1 $(date +%T)"
python3 benchmarks/jpeg_data.py --out /tmp/jpeg $J --sides synthetic,mixed,mixed:0.1,mixed:0.2 2>&1 | grep "^|"
echo "== round 2 $(date +%T)"
python3 benchmarks/jpeg_data.py --out /tmp/r2 $J --sides mixed:0.2,mixed:0.1,mixed 2>&1 | grep "^|"
for d in jpeg r2; do for m in /tmp/$d/runs/*/metrics.jsonl; do echo "== $d $(basename $(dirname $m))"; python3 -c "
import json, sys
rows=[json.loads(l) for l in open(sys.argv[1])]
print([(r.get('step'), round(r['samples_per_s_per_gpu']), round(r.get('data_wait_fraction', 0), 2)) for r in rows if 'samples_per_s_per_gpu' in r])" $m; done; done
mkdir -p $OUT/call1 && for d in jpeg r2; do mkdir -p $OUT/call1/$d; cp /tmp/$d/*.log /tmp/$d/jpeg_data.json $OUT/call1/$d/ 2>/dev/null; for m in /tmp/$d/runs/*; do cp $m/metrics.jsonl $OUT/call1/$d/$(basename $m)-metrics.jsonl; done; done
cp gpu1.sh $OUT/call1/
echo "end $(date +%T)"

# Session 10, call 2 (issue #15): the next epoch's workers wait after 2 batches each (new, HEAD) beside
# a880317 (old: they fill their whole prefetch, 4 each, while the epoch's last batches are made); 'mixed',
# ViT-B-32, 1×H200, 8 workers, 32 shards (125 batches per epoch), 250 steps; synthetic first in the same call.
# The CUDA tests of tests/test_decode.py on this tree first.
source setup.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-test/*.whl 2>&1 | grep -v WARNING | tail -1
echo "start $(date +%T)"
python3 -m pytest -q -p no:cacheprovider tests/test_decode.py 2>&1 | tail -2
python3 - <<'PY'
import sys, time; sys.path.insert(0, "benchmarks")
from pathlib import Path
from jpeg_data import write_shards
t = time.time(); print(write_shards(Path("/tmp/jpeg/shards"), 32, 1000, 256), round(time.time() - t, 1), "s", flush=True)
PY
J="--shards 32 --per-shard 1000 --gpus 1 --model ViT-B-32 --batch 256 --steps 250 --timeout 120 --workers 8"
for d in new1 old1 new2 old2 syn; do mkdir -p /tmp/$d && ln -sf /tmp/jpeg/shards /tmp/$d/shards; done
echo "== synthetic $(date +%T)"; python3 benchmarks/jpeg_data.py --out /tmp/syn $J --sides synthetic 2>&1 | grep "^| s"
echo "== new1 $(date +%T)"; python3 benchmarks/jpeg_data.py --out /tmp/new1 $J --sides mixed 2>&1 | grep "^| m"
echo "== old1 $(date +%T)"; (cd old && PYTHONPATH=/tmp/site:$PWD python3 benchmarks/jpeg_data.py --out /tmp/old1 $J --sides mixed 2>&1 | grep "^| m")
echo "== old2 $(date +%T)"; (cd old && PYTHONPATH=/tmp/site:$PWD python3 benchmarks/jpeg_data.py --out /tmp/old2 $J --sides mixed 2>&1 | grep "^| m")
echo "== new2 $(date +%T)"; python3 benchmarks/jpeg_data.py --out /tmp/new2 $J --sides mixed 2>&1 | grep "^| m"
for d in syn new1 old1 old2 new2; do for m in /tmp/$d/runs/*/metrics.jsonl; do echo "== $d"; python3 -c "
import json, sys
rows=[json.loads(l) for l in open(sys.argv[1])]
print([(r.get('step'), round(r['samples_per_s_per_gpu']), round(r.get('data_wait_fraction', 0), 2)) for r in rows if 'samples_per_s_per_gpu' in r])" $m; done; done
mkdir -p /tmp/keep && for d in syn new1 old1 old2 new2; do mkdir -p /tmp/keep/$d; cp /tmp/$d/*.log /tmp/$d/jpeg_data.json /tmp/keep/$d/; cp /tmp/$d/runs/*/metrics.jsonl /tmp/keep/$d/; done
cp gpu2.sh /tmp/keep/ && tar -czf $OUT/call2.tgz -C /tmp/keep .
echo "end $(date +%T)"

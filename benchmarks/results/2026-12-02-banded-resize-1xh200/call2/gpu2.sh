# Session 11, call 2 (issue #15): resize_probe2.py (three trees' pinning-thread call), the CUDA tests of
# tests/test_decode.py on this tree (c82d848), then 'mixed' training: c82d848 (new), d29d0b9 (mid, banded
# weights only), edec907 (old), in the order new, old, mid, old, new; ViT-B-32, 1×H200, 8 workers, 64 shards
# (250 batches an epoch: no epoch begins or starts its workers in 200 steps), 200 steps; synthetic first.
source setup.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-test/*.whl 2>&1 | grep -v WARNING | tail -1
mkdir -p /tmp/keep && cp gpu2.sh /tmp/keep/
keep() { tar -czf $OUT/call2.tgz -C /tmp/keep .; }
echo "start $(date +%T)"
python3 benchmarks/results/2026-12-02-banded-resize-1xh200/resize_probe2.py 2>&1 | grep -v Warn | tee /tmp/keep/probe2.txt; keep
python3 -m pytest -q -p no:cacheprovider tests/test_decode.py 2>&1 | tail -2 | tee /tmp/keep/pytest.txt
python3 - <<'PY'
import sys, time; sys.path.insert(0, "benchmarks")
from pathlib import Path
from jpeg_data import write_shards
t = time.time(); print(write_shards(Path("/tmp/jpeg/shards"), 64, 1000, 256), round(time.time() - t, 1), "s", flush=True)
PY
J="--shards 64 --per-shard 1000 --gpus 1 --model ViT-B-32 --batch 256 --steps 200 --timeout 120 --workers 8"
rates() { for m in /tmp/$1/runs/*/metrics.jsonl; do python3 -c "
import json, sys
rows=[json.loads(l) for l in open(sys.argv[1])]
print([(r.get('step'), round(r['samples_per_s_per_gpu']), round(r.get('data_wait_fraction', 0), 2)) for r in rows if 'samples_per_s_per_gpu' in r])" $m; done
  mkdir -p /tmp/keep/$1; cp /tmp/$1/*.log /tmp/$1/jpeg_data.json /tmp/$1/runs/*/metrics.jsonl /tmp/keep/$1/ 2>/dev/null; keep; }
for d in new1 old1 mid1 old2 new2 syn; do mkdir -p /tmp/$d && ln -sf /tmp/jpeg/shards /tmp/$d/shards; done
echo "== synthetic $(date +%T)"; python3 benchmarks/jpeg_data.py --out /tmp/syn $J --sides synthetic 2>&1 | grep "^| s"; rates syn
echo "== new1 $(date +%T)"; python3 benchmarks/jpeg_data.py --out /tmp/new1 $J --sides mixed 2>&1 | grep "^| m"; rates new1
echo "== old1 $(date +%T)"; (cd old && PYTHONPATH=/tmp/site:$PWD python3 benchmarks/jpeg_data.py --out /tmp/old1 $J --sides mixed 2>&1 | grep "^| m"); rates old1
echo "== mid1 $(date +%T)"; (cd mid && PYTHONPATH=/tmp/site:$PWD python3 benchmarks/jpeg_data.py --out /tmp/mid1 $J --sides mixed 2>&1 | grep "^| m"); rates mid1
echo "== old2 $(date +%T)"; (cd old && PYTHONPATH=/tmp/site:$PWD python3 benchmarks/jpeg_data.py --out /tmp/old2 $J --sides mixed 2>&1 | grep "^| m"); rates old2
echo "== new2 $(date +%T)"; python3 benchmarks/jpeg_data.py --out /tmp/new2 $J --sides mixed 2>&1 | grep "^| m"; rates new2
echo "end $(date +%T)"

# Session 11, call 3 (issue #15): the workers' own supply on this host (data_rate.py, 'mixed', 8 workers,
# no step), then 'mixed' training: c82d848 (new) beside edec907 (old), in the order new, old, old, new;
# ViT-B-32, 1×H200, 8 workers, 32 shards (125 batches an epoch), 250 steps, as call 1; synthetic first.
source setup.sh
mkdir -p /tmp/keep && cp gpu3.sh /tmp/keep/
keep() { tar -czf $OUT/call3.tgz -C /tmp/keep .; }
echo "start $(date +%T)"
python3 - <<'PY'
import sys, time; sys.path.insert(0, "benchmarks")
from pathlib import Path
from jpeg_data import write_shards
t = time.time(); print(write_shards(Path("/tmp/jpeg/shards"), 32, 1000, 256), round(time.time() - t, 1), "s", flush=True)
PY
echo "== workers alone $(date +%T)"
python3 benchmarks/data_rate.py --urls '/tmp/jpeg/shards/{000000..000031}.tar' --samples 32000 --workers 8 --decode mixed --batches 60 --skip 20 --out /tmp/keep/data_rate.json 2>&1 | grep -E "^\||^\{" | tee /tmp/keep/data_rate.txt; keep
J="--shards 32 --per-shard 1000 --gpus 1 --model ViT-B-32 --batch 256 --steps 250 --timeout 120 --workers 8"
rates() { for m in /tmp/$1/runs/*/metrics.jsonl; do python3 -c "
import json, sys
rows=[json.loads(l) for l in open(sys.argv[1])]
print([(r.get('step'), round(r['samples_per_s_per_gpu']), round(r.get('data_wait_fraction', 0), 2)) for r in rows if 'samples_per_s_per_gpu' in r])" $m; done
  mkdir -p /tmp/keep/$1; cp /tmp/$1/*.log /tmp/$1/jpeg_data.json /tmp/$1/runs/*/metrics.jsonl /tmp/keep/$1/ 2>/dev/null; keep; }
for d in new1 old1 old2 new2 syn; do mkdir -p /tmp/$d && ln -sf /tmp/jpeg/shards /tmp/$d/shards; done
echo "== synthetic $(date +%T)"; python3 benchmarks/jpeg_data.py --out /tmp/syn $J --sides synthetic 2>&1 | grep "^| s"; rates syn
echo "== new1 $(date +%T)"; python3 benchmarks/jpeg_data.py --out /tmp/new1 $J --sides mixed 2>&1 | grep "^| m"; rates new1
echo "== old1 $(date +%T)"; (cd old && PYTHONPATH=/tmp/site:$PWD python3 benchmarks/jpeg_data.py --out /tmp/old1 $J --sides mixed 2>&1 | grep "^| m"); rates old1
echo "== old2 $(date +%T)"; (cd old && PYTHONPATH=/tmp/site:$PWD python3 benchmarks/jpeg_data.py --out /tmp/old2 $J --sides mixed 2>&1 | grep "^| m"); rates old2
echo "== new2 $(date +%T)"; python3 benchmarks/jpeg_data.py --out /tmp/new2 $J --sides mixed 2>&1 | grep "^| m"; rates new2
echo "end $(date +%T)"

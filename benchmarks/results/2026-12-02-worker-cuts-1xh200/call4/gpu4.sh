# Session 12, call 4 (issue #15): 'mixed' training, 8dbc437 ("new") beside 5061a47 ("old"), ViT-B-32, 1xH200,
# 8 workers, 40 shards (156 batches an epoch: no epoch start or early start in 120 steps), old first (its run
# also compiles cold).
source setup.sh
mkdir -p /tmp/keep && cp gpu4.sh /tmp/keep/
keep() { tar -czf $OUT/call4.tgz -C /tmp/keep .; }
echo "start $(date +%T)"
python3 - <<'PY'
import sys, time; sys.path.insert(0, "benchmarks")
from pathlib import Path
from jpeg_data import write_shards
t = time.time(); print(write_shards(Path("/tmp/jpeg/shards"), 40, 1000, 256), round(time.time() - t, 1), "s", flush=True)
PY
J="--shards 40 --per-shard 1000 --gpus 1 --model ViT-B-32 --batch 256 --steps 120 --timeout 100 --workers 8"
rates() { for m in /tmp/$1/runs/*/metrics.jsonl; do python3 -c "
import json, sys
rows=[json.loads(l) for l in open(sys.argv[1])]
print([(r.get('step'), round(r['samples_per_s_per_gpu']), round(r.get('data_wait_fraction', 0), 2)) for r in rows if 'samples_per_s_per_gpu' in r]); print(rows[0].get('startup_s'))" $m; done
  mkdir -p /tmp/keep/$1; cp /tmp/$1/*.log /tmp/$1/jpeg_data.json /tmp/$1/runs/*/metrics.jsonl /tmp/keep/$1/ 2>/dev/null; keep; }
for d in new old; do mkdir -p /tmp/$d && ln -sf /tmp/jpeg/shards /tmp/$d/shards; done
echo "== old $(date +%T)"; (cd old && PYTHONPATH=/tmp/site:$PWD python3 benchmarks/jpeg_data.py --out /tmp/old $J --sides mixed 2>&1 | grep "^| m"); rates old
echo "== new $(date +%T)"; python3 benchmarks/jpeg_data.py --out /tmp/new $J --sides mixed 2>&1 | grep "^| m"; rates new
echo "end $(date +%T)"

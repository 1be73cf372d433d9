# Session 10, call 3 (issue #15): the next epoch's workers forked on a thread of their own (new, HEAD) beside
# fb432ca (old: forked on the training thread); 'mixed', ViT-B-32, 1×H200, 8 workers, 32 shards (125 batches
# per epoch, early starts at batches 93 and 218), 250 steps; new, old, old, new. Synthetic: 6,088 and 6,096
# in calls 1 and 2 (not rerun: device time).
source setup.sh
echo "start $(date +%T)"
python3 - <<'PY'
import sys, time; sys.path.insert(0, "benchmarks")
from pathlib import Path
from jpeg_data import write_shards
t = time.time(); print(write_shards(Path("/tmp/jpeg/shards"), 32, 1000, 256), round(time.time() - t, 1), "s", flush=True)
PY
J="--shards 32 --per-shard 1000 --gpus 1 --model ViT-B-32 --batch 256 --steps 250 --timeout 120 --workers 8 --sides mixed"
mkdir -p /tmp/keep && cp gpu3.sh /tmp/keep/
for d in new1 old1 old2 new2; do
  mkdir -p /tmp/$d && ln -sf /tmp/jpeg/shards /tmp/$d/shards
  echo "== $d $(date +%T)"
  if [[ $d == new* ]]; then python3 benchmarks/jpeg_data.py --out /tmp/$d $J 2>&1 | grep "^| m"
  else (cd old && PYTHONPATH=/tmp/site:$PWD python3 benchmarks/jpeg_data.py --out /tmp/$d $J 2>&1 | grep "^| m"); fi
  python3 -c "
import json, sys
rows=[json.loads(l) for l in open(sys.argv[1])]
print([(r.get('step'), round(r['samples_per_s_per_gpu']), round(r.get('data_wait_fraction', 0), 2)) for r in rows if 'samples_per_s_per_gpu' in r])" /tmp/$d/runs/decode-mixed/metrics.jsonl
  grep -ho "epoch [0-9]*'s [0-9]* workers started in [0-9.]* s" /tmp/$d/decode-mixed.log
  mkdir -p /tmp/keep/$d && cp /tmp/$d/*.log /tmp/$d/jpeg_data.json /tmp/$d/runs/decode-mixed/metrics.jsonl /tmp/keep/$d/
  tar -czf $OUT/call3.tgz -C /tmp/keep .
done
echo "end $(date +%T)"

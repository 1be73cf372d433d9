# Session 9, call 5 (issue #15): the next epoch's workers started during the last batches of an epoch (new)
# beside HEAD 69dd3ae (old: they start when the epoch begins); 'mixed', 8 workers, 16 shards = 62 batches
# per epoch, so 150 steps cross two epochs.
source setup.sh
echo "start $(date +%T)"
python3 - <<'PY'
import sys, time; sys.path.insert(0, "benchmarks")
from pathlib import Path
from jpeg_data import write_shards
t = time.time(); print(write_shards(Path("/tmp/jpeg/shards"), 16, 1000, 256), round(time.time() - t, 1), "s", flush=True)
PY
J="--shards 16 --per-shard 1000 --gpus 1 --model ViT-B-32 --batch 256 --steps 150 --timeout 100 --workers 8 --sides mixed"
mkdir -p /tmp/jpeg-old && ln -sf /tmp/jpeg/shards /tmp/jpeg-old/shards
echo "== new $(date +%T)"
timeout 130 python3 benchmarks/jpeg_data.py --out /tmp/jpeg $J 2>&1 | grep "^|"
echo "== old $(date +%T)"
(cd old && PYTHONPATH=/tmp/site:$PWD timeout 100 python3 benchmarks/jpeg_data.py --out /tmp/jpeg-old $J 2>&1 | grep "^|")
for d in jpeg jpeg-old; do echo "== $d"; python3 -c "
import json
rows=[json.loads(l) for l in open('/tmp/$d/runs/decode-mixed/metrics.jsonl')]
print([(r.get('step'), round(r['samples_per_s_per_gpu']), round(r.get('data_wait_fraction', 0), 2)) for r in rows if 'samples_per_s_per_gpu' in r])"; done
echo "end $(date +%T)"

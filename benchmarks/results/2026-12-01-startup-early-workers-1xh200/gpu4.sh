# Launch -> first step of ViT-B-32 on JPEG shards, G GPUs (default 2), 8 workers/GPU: 0a5ed2b (old: workers start at
# the first batch) and ac9c54d (new: a fresh run's workers start while the model is built), alternating on one host,
# warm inductor cache (one cold launch of the new tree first fills it).
source setup.sh
nproc; echo "start $(date +%T)"
mkdir -p $OUT/s /tmp/jp
python3 -c "
import sys, time; sys.path.insert(0, 'benchmarks'); from jpeg_data import write_shards
t = time.time(); print(write_shards(__import__('pathlib').Path('/tmp/jp/shards'), 32, 1000, 256), round(time.time() - t, 1), 's')"
for side in old new; do python3 - $side ${G:-2} <<'PY'
import json, sys
side = sys.argv[1]
job = {"run": {"name": side, "output_dir": "/tmp/jp/runs"}, "model": {"name": "ViT-B-32"},
       "schedule": {"kind": "constant", "steps": 3}, "batch": {"per_gpu": 256},
       "data": {"urls": "/tmp/jp/shards/{000000..000031}.tar", "samples": 32000, "workers": 8},
       "checkpoint": {"at_end": False, "resume": None}, "logging": {"every_steps": 1},
       "launch": {"gpus_per_node": int(sys.argv[2]), "env": {"TORCHINDUCTOR_CACHE_DIR": "/tmp/jp/inductor"}}}
open(f"/tmp/jp/{side}.json", "w").write(json.dumps(job))
PY
done
launch() { # side tag
  rm -rf /tmp/jp/runs/$1
  if [ $1 = old ]; then d=$PWD/old; else d=$PWD; fi
  (cd $d && PYTHONPATH=/tmp/site:$d timeout -k 10 150 python3 -m fsdpclip launch /tmp/jp/$1.json > $OUT/s/$1-$2.log 2>&1)
  echo "$1-$2 rc $? $(date +%T)"
  cp /tmp/jp/runs/$1/metrics.jsonl $OUT/s/$1-$2-metrics.jsonl 2>/dev/null
  python3 -c "
import json; r = json.loads(open('/tmp/jp/runs/$1/metrics.jsonl').readline())
print('$1-$2', round(r['time_to_first_step_s'], 2), {k: round(v, 2) for k, v in r['startup_s'].items()})" 2>&1 | tail -1
}
launch new cold
for i in 1 2 3; do launch old $i; launch new $i; done
echo "end $(date +%T)"

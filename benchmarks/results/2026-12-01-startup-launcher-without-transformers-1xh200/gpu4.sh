# ViT-B-32 on JPEG shards (as gpu3.sh), efc462a (old: forked ranks, the launcher imports transformers) against
# 6371ba8 (new: the launcher imports OpenCLIP without transformers), alternating, warm inductor cache; 'cmd' =
# from the `fsdpclip launch` command's start (validation included) to the first step's metrics record. Then
# one ViT-bigG-14 launch (synthetic data, batch 32, default spec) of the new tree: a large model's parallel
# initial weights in a forked rank.
source setup.sh
nproc; echo "start $(date +%T)"
mkdir -p $OUT/s /tmp/jp
python3 -c "
import sys, time; sys.path.insert(0, 'benchmarks'); from jpeg_data import write_shards
t = time.time(); print(write_shards(__import__('pathlib').Path('/tmp/jp/shards'), 16, 1000, 256), round(time.time() - t, 1), 's')"
for side in old new; do python3 - $side <<'PY'
import json, sys
side = sys.argv[1]
job = {"run": {"name": side, "output_dir": "/tmp/jp/runs"}, "model": {"name": "ViT-B-32"},
       "schedule": {"kind": "constant", "steps": 3}, "batch": {"per_gpu": 256},
       "data": {"urls": "/tmp/jp/shards/{000000..000015}.tar", "samples": 16000, "workers": 8},
       "checkpoint": {"at_end": False, "resume": None}, "logging": {"every_steps": 1},
       "launch": {"gpus_per_node": 1, "env": {"TORCHINDUCTOR_CACHE_DIR": "/tmp/jp/inductor"}}}
open(f"/tmp/jp/{side}.json", "w").write(json.dumps(job))
PY
done
python3 -c "
import json
job = {'run': {'name': 'bigg', 'output_dir': '/tmp/jp/runs'}, 'model': {'name': 'ViT-bigG-14'},
       'schedule': {'kind': 'constant', 'steps': 2}, 'batch': {'per_gpu': 32}, 'data': {'source': 'synthetic'},
       'checkpoint': {'at_end': False, 'resume': None}, 'logging': {'every_steps': 1},
       'launch': {'gpus_per_node': 1, 'env': {'TORCHINDUCTOR_CACHE_DIR': '/tmp/jp/inductor'}}}
open('/tmp/jp/bigg.json', 'w').write(json.dumps(job))"
launch() { # spec tag [tree]
  rm -rf /tmp/jp/runs/$1
  if [ "$3" = old ]; then d=$PWD/old; else d=$PWD; fi
  t0=$(date +%s.%N)
  (cd $d && PYTHONPATH=/tmp/site:$d timeout -k 10 170 python3 -m fsdpclip launch /tmp/jp/$1.json > $OUT/s/$1-$2.log 2>&1)
  echo "$1-$2 rc $? $(date +%T)"
  cp /tmp/jp/runs/$1/metrics.jsonl $OUT/s/$1-$2-metrics.jsonl 2>/dev/null
  python3 -c "
import json; r = json.loads(open('/tmp/jp/runs/$1/metrics.jsonl').readline())
print('$1-$2', round(r['time_to_first_step_s'], 2), 'cmd', round(r['time'] - $t0, 2), r.get('samples_per_s_per_gpu'), {k: round(v, 2) for k, v in r['startup_s'].items()})" 2>&1 | tail -1
}
launch new cold
for i in 1 2; do launch old $i old; launch new $i; done
launch bigg 1
grep -v "^W1201" $OUT/s/bigg-1.log | grep -m6 "rank 0\|Error\|error"
echo "end $(date +%T)"
tar czf $OUT/s.tgz -C $OUT s && rm -rf $OUT/s

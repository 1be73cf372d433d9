# Launch -> first step of ViT-B-32 on JPEG shards, G GPUs (default 1), 8 workers/GPU: 8714174 (old: before
# changes 21-23) and HEAD (new), alternating on one host, warm inductor cache (one cold launch of the new tree
# first fills it); then one launch of each without compile.
source setup.sh
nproc; echo "start $(date +%T)"
mkdir -p $OUT/s /tmp/jp
python3 -X importtime -c "import fsdpclip.train" 2> $OUT/s/importtime-train.txt
python3 -X importtime -c "import fsdpclip.trainer" 2> $OUT/s/importtime-trainer.txt
python3 -c "
import sys, time; sys.path.insert(0, 'benchmarks'); from jpeg_data import write_shards
t = time.time(); print(write_shards(__import__('pathlib').Path('/tmp/jp/shards'), 16, 1000, 256), round(time.time() - t, 1), 's')"
for side in old new; do for compile in auto false; do python3 - $side ${G:-1} $compile <<'PY'
import json, sys
side, gpus, compile = sys.argv[1], int(sys.argv[2]), sys.argv[3]
job = {"run": {"name": side, "output_dir": "/tmp/jp/runs"}, "model": {"name": "ViT-B-32"},
       "schedule": {"kind": "constant", "steps": 3}, "batch": {"per_gpu": 256},
       "data": {"urls": "/tmp/jp/shards/{000000..000015}.tar", "samples": 16000, "workers": 8},
       "checkpoint": {"at_end": False, "resume": None}, "logging": {"every_steps": 1},
       "fsdp": {"compile": compile if compile == "auto" else False},
       "launch": {"gpus_per_node": gpus, "env": {"TORCHINDUCTOR_CACHE_DIR": "/tmp/jp/inductor"}}}
open(f"/tmp/jp/{side}-{compile}.json", "w").write(json.dumps(job))
PY
done; done
launch() { # side compile tag
  rm -rf /tmp/jp/runs/$1
  if [ $1 = old ]; then d=$PWD/old; else d=$PWD; fi
  (cd $d && PYTHONPATH=/tmp/site:$d timeout -k 10 150 python3 -m fsdpclip launch /tmp/jp/$1-$2.json > $OUT/s/$1-$2-$3.log 2>&1)
  echo "$1-$2-$3 rc $? $(date +%T)"
  cp /tmp/jp/runs/$1/metrics.jsonl $OUT/s/$1-$2-$3-metrics.jsonl 2>/dev/null
  python3 -c "
import json; r = json.loads(open('/tmp/jp/runs/$1/metrics.jsonl').readline())
print('$1-$2-$3', round(r['time_to_first_step_s'], 2), {k: round(v, 2) for k, v in r['startup_s'].items()})" 2>&1 | tail -1
}
launch new auto cold
for i in 1 2 3; do launch old auto $i; launch new auto $i; done
launch old false 1; launch new false 1
echo "end $(date +%T)"
# Ran as `bash gpu1.sh` on 1xH200 (16 host cores), 2026-12-01, new = 2be2743; .whl/ and setup.sh as in
# gpu3.sh. The device tool returned 8 of the files (its file count): console.txt holds every row.

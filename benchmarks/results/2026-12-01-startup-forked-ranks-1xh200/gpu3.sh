# Launch -> first step of ViT-B-32 on JPEG shards, G GPUs (default 1), 8 workers/GPU: 609b34b (old: the last
# session's) and this tree (new: FLOP count on plain meta tensors, torchrun and the ranks forked from the
# launcher), alternating on one host, warm inductor cache (one cold launch of the new tree first fills it).
# 'cmd' = from the `fsdpclip launch` command's start (validation included) to the first step's metrics record.
source setup.sh
nproc; echo "start $(date +%T)"
PYTORCH_NVML_BASED_CUDA_CHECK=1 python3 -c "
import os, torch
print('nvml', torch.cuda._device_count_nvml(), torch.accelerator.is_available(), torch.accelerator.device_count())
pid = os.fork()
if pid == 0:
    torch.cuda.set_device(0); print('forked child uses CUDA:', torch.ones(1, device='cuda').item()); os._exit(0)
print('child', os.waitpid(pid, 0))"
mkdir -p $OUT/s /tmp/jp
python3 -c "
import sys, time; sys.path.insert(0, 'benchmarks'); from jpeg_data import write_shards
t = time.time(); print(write_shards(__import__('pathlib').Path('/tmp/jp/shards'), 16, 1000, 256), round(time.time() - t, 1), 's')"
for side in old new; do python3 - $side ${G:-1} <<'PY'
import json, sys
side, gpus = sys.argv[1], int(sys.argv[2])
job = {"run": {"name": side, "output_dir": "/tmp/jp/runs"}, "model": {"name": "ViT-B-32"},
       "schedule": {"kind": "constant", "steps": 3}, "batch": {"per_gpu": 256},
       "data": {"urls": "/tmp/jp/shards/{000000..000015}.tar", "samples": 16000, "workers": 8},
       "checkpoint": {"at_end": False, "resume": None}, "logging": {"every_steps": 1},
       "launch": {"gpus_per_node": gpus, "env": {"TORCHINDUCTOR_CACHE_DIR": "/tmp/jp/inductor"}}}
open(f"/tmp/jp/{side}.json", "w").write(json.dumps(job))
PY
done
launch() { # side tag
  rm -rf /tmp/jp/runs/$1
  if [ $1 = old ]; then d=$PWD/old; else d=$PWD; fi
  t0=$(date +%s.%N)
  (cd $d && PYTHONPATH=/tmp/site:$d timeout -k 10 150 python3 -m fsdpclip launch /tmp/jp/$1.json > $OUT/s/$1-$2.log 2>&1)
  echo "$1-$2 rc $? $(date +%T)"
  cp /tmp/jp/runs/$1/metrics.jsonl $OUT/s/$1-$2-metrics.jsonl 2>/dev/null
  python3 -c "
import json; r = json.loads(open('/tmp/jp/runs/$1/metrics.jsonl').readline())
print('$1-$2', round(r['time_to_first_step_s'], 2), 'cmd', round(r['time'] - $t0, 2), {k: round(v, 2) for k, v in r['startup_s'].items()})" 2>&1 | tail -1
}
launch new cold
if [ ! -f $OUT/s/new-cold-metrics.jsonl ]; then grep -v "^W1201" $OUT/s/new-cold.log | tail -30; tar czf $OUT/s.tgz -C $OUT s && rm -rf $OUT/s; exit 1; fi
grep -m1 "fsdpclip.torchrun" $OUT/s/new-cold.log
for i in 1 2; do launch old $i; launch new $i; done
echo "end $(date +%T)"
tar czf $OUT/s.tgz -C $OUT s && rm -rf $OUT/s

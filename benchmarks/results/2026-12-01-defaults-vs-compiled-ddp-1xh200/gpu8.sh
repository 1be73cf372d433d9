source setup.sh
mkdir -p $OUT/r
echo "=== imports $(date +%T)"
for i in 1 2; do
python3 -c "
import time; import torch, torchvision, torch.distributed.fsdp, fsdpclip.train
from fsdpclip.train import without_modules
t=time.time()
with without_modules(('transformers',)): import open_clip
print('open_clip without transformers', round(time.time()-t,2))"
python3 -c "
import time; import torch, torchvision, torch.distributed.fsdp, fsdpclip.train
t=time.time(); import open_clip; print('open_clip with transformers', round(time.time()-t,2))"
done
launch1() { # tree tag
  cat > /tmp/b32-$2.json <<JSON
{"run": {"name": "startup-$2", "output_dir": "/tmp/runs"}, "model": {"name": "ViT-B-32"},
 "schedule": {"kind": "constant", "steps": 3}, "data": {"source": "synthetic"}, "batch": {"per_gpu": 256},
 "checkpoint": {"at_end": false}, "logging": {"every_steps": 1},
 "launch": {"gpus_per_node": 1, "env": {"TORCHINDUCTOR_CACHE_DIR": "/tmp/inductor-b32"}}}
JSON
  (cd $1 && PYTHONPATH=/tmp/site:$PWD timeout -k 10 120 python3 -m fsdpclip launch /tmp/b32-$2.json > $OUT/r/startup-$2.log 2>&1; echo "$2 rc $?")
  echo "$2 $(head -1 /tmp/runs/startup-$2/metrics.jsonl | grep -o '"startup_s": {[^}]*}')"
  cp /tmp/runs/startup-$2/metrics.jsonl $OUT/r/startup-$2-metrics.jsonl
}
echo "=== startup $(date +%T)"
launch1 . cold-new
for i in 1 2 3; do launch1 old warm-old-$i; launch1 . warm-new-$i; done
echo "end $(date +%T)"

# Session 8, call 1: where ViT-B-32's JPEG supply stops (issue #15): the data pipeline without a model
# (workers alone vs. made the model's input on the device; the device decode's parts), and the workers'
# per-sample cost on this host's cores.
source setup.sh
echo "start $(date +%T)"; nproc; python3 -c "import torch, torchvision; print(torch.__version__, torchvision.__version__)"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
python3 - <<'PY'
import sys, time; sys.path.insert(0, "benchmarks")
from pathlib import Path
from jpeg_data import write_shards
t = time.time(); print(write_shards(Path("/tmp/jpeg/shards"), 32, 1000, 256), round(time.time() - t, 1), "s", flush=True)
PY
mkdir -p $OUT/r
timeout 150 python3 benchmarks/data_rate.py --urls '/tmp/jpeg/shards/{000000..000031}.tar' --samples 32000 \
  --workers 8 --decode gpu --batches 100 --skip 40 --parts --part-batches 30 --out $OUT/r/parts.jsonl 2>&1 | grep -v Warning | tail -8
timeout 240 python3 benchmarks/data_rate.py --urls '/tmp/jpeg/shards/{000000..000031}.tar' --samples 32000 \
  --workers 4 12 --decode gpu --batches 100 --skip 40 --out $OUT/r/rates.jsonl 2>&1 | grep -v Warning | tail -8
timeout 60 python3 benchmarks/worker_profile.py --dir /tmp/prof 2>&1 | tail -14
echo "end $(date +%T)"

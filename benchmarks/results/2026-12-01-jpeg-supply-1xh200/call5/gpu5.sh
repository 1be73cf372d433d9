# Session 8, call 5 (issue #15; run twice: the second with --threads 1 2 4 8): torchvision's nvJPEG batch decode vs nvJPEG's batched decode called
# directly (initialised once, high-priority stream, no host sync in the call), idle and beside a busy GPU.
source setup.sh
echo "start $(date +%T)"
python3 - <<'PY'
import sys, time; sys.path.insert(0, "benchmarks")
from pathlib import Path
from jpeg_data import write_shards
t = time.time(); print(write_shards(Path("/tmp/jpeg/shards"), 4, 1000, 256), round(time.time() - t, 1), "s", flush=True)
PY
timeout 200 python3 benchmarks/nvjpeg_overlap.py --urls '/tmp/jpeg/shards/{000000..000003}.tar' --batches 12 --busy-ms 42 --threads 1 2 4 8 2>&1 | grep "^{"
echo "end $(date +%T)"

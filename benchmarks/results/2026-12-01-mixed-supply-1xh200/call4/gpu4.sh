# Session 9, call 4 (issue #15): one 'mixed' worker's cost on this host, old (HEAD b31668f: PIL decode) vs new
# (torchvision's libjpeg-turbo) vs v2 (new, and the padded batch written once, not zeroed first), in one
# process (ms and minor page faults per sample) and as 8 DataLoader workers, alternating.
source setup.sh
echo "start $(date +%T)"
python3 - <<'PY'
import sys, time; sys.path.insert(0, "benchmarks")
from pathlib import Path
from jpeg_data import write_shards
t = time.time(); print(write_shards(Path("/tmp/jpeg/shards"), 16, 1000, 256), round(time.time() - t, 1), "s", flush=True)
PY
U='/tmp/jpeg/shards/{000000..000015}.tar'
W=$PWD/worker_faults.py
for tree in old new v2; do d=.; [ $tree != new ] && d=$tree
  (cd $d && PYTHONPATH=/tmp/site:$PWD timeout 60 python3 -P $W $tree "$U" 2>&1 | grep -v "^$" | head -14 | cut -c1-150)
done
for round in 1 2; do for tree in new old v2; do d=.; [ $tree != new ] && d=$tree
  echo "== $tree $(date +%T)"
  (cd $d && PYTHONPATH=/tmp/site:$PWD timeout 60 python3 benchmarks/data_rate.py --urls "$U" --samples 16000 --workers 8 --decode mixed --batches 60 --skip 20 2>&1 | grep '"workers"')
done; done
echo "end $(date +%T)"

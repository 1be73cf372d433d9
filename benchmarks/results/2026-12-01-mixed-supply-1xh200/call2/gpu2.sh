# Session 9, call 2 (issue #15): why 8 'mixed' workers deliver only ~4,500 samples/s on this host: its CPUs,
# one worker's parts in one process (worker_cost.py), and the workers' rate from 1 to 16 workers.
source setup.sh
echo "start $(date +%T)"
nproc; cat /sys/fs/cgroup/cpu.max 2>/dev/null; lscpu | grep -E "Model name|^CPU\(s\)|Thread|Core|Socket|MHz|NUMA node\(s\)"
python3 - <<'PY'
import sys, time; sys.path.insert(0, "benchmarks")
from pathlib import Path
from jpeg_data import write_shards
t = time.time(); print(write_shards(Path("/tmp/jpeg/shards"), 8, 1000, 256), round(time.time() - t, 1), "s", flush=True)
PY
U='/tmp/jpeg/shards/{000000..000007}.tar'
timeout 150 python3 worker_cost.py "$U" 2>&1 | grep -v Warn
echo "== workers $(date +%T)"
timeout 240 python3 benchmarks/data_rate.py --urls "$U" --samples 8000 --workers 1 2 4 8 12 16 --decode mixed --batches 30 --skip 10 2>&1 | grep '"workers"'
echo "== top during 8 workers $(date +%T)"
(timeout 60 python3 benchmarks/data_rate.py --urls "$U" --samples 8000 --workers 8 --decode mixed --batches 30 --skip 10 >/dev/null 2>&1 &) ; sleep 8; top -b -n 1 | head -30
sleep 10; echo "end $(date +%T)"

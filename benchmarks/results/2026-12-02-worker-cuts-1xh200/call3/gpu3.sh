# Session 12, call 3 (issue #15): the workers' per-sample work cut (8dbc437: crop_box, read_header, captions
# tokenised per batch; "new") beside 5061a47 ("old"): a worker's own clock and parts (worker_clock.py), the
# workers alone (data_rate.py, 8), then ViT-B-32 training on a long epoch (64 shards, 200 steps), synthetic first.
source setup.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/spy .whl-test/*.whl
SPY=/tmp/spy/bin/py-spy
mkdir -p /tmp/keep && cp gpu3.sh worker_clock.py /tmp/keep/
keep() { tar -czf $OUT/call3.tgz -C /tmp/keep .; }
echo "start $(date +%T)"
python3 - > /tmp/keep/shards.txt 2>&1 <<'PY' &
import sys, time; sys.path.insert(0, "benchmarks")
from pathlib import Path
from jpeg_data import write_shards
t = time.time(); print(write_shards(Path("/tmp/jpeg/shards"), 64, 1000, 256), round(time.time() - t, 1), "s", flush=True)
PY
SHARDS=$!
echo "== CUDA tests $(date +%T)"; PYTHONPATH=$PYTHONPATH:/tmp/spy python3 -m pytest -q -p no:cacheprovider tests/test_decode.py 2>&1 | tail -3 | tee /tmp/keep/tests.txt
python3 cropcheck.py 2>&1 | tail -3 | tee /tmp/keep/cropcheck.txt
wait $SHARDS; cat /tmp/keep/shards.txt; keep
S='/tmp/jpeg/shards/{000000..000031}.tar'
clock() { if [ $1 = new ]; then python3 worker_clock.py "${@:2}"; else (cd old && PYTHONPATH=/tmp/site:$PWD python3 worker_clock.py "${@:2}"); fi; }
for t in new old old new; do echo "== clock 1 worker $t $(date +%T)"; clock $t "$S" 32000 1 30 --parts 2>&1 | tail -1 | sed "s/^/$t /" | tee -a /tmp/keep/clock.txt; done; keep
for t in new old old new; do echo "== clock 8 workers $t $(date +%T)"; clock $t "$S" 32000 8 90 2>&1 | tail -1 | sed "s/^/$t /" | tee -a /tmp/keep/clock.txt; done; keep
U="--urls $S --samples 32000 --decode mixed --batches 60 --skip 20 --workers 8"
for t in new old; do echo "== data_rate $t $(date +%T)"
  if [ $t = new ]; then python3 benchmarks/data_rate.py $U 2>&1 | grep -E "^\{" | sed "s/^/$t /" | tee -a /tmp/keep/data_rate.txt
  else (cd old && PYTHONPATH=/tmp/site:$PWD python3 benchmarks/data_rate.py $U 2>&1 | grep -E "^\{" | sed "s/^/$t /" | tee -a /tmp/keep/data_rate.txt); fi
done; keep
J="--shards 64 --per-shard 1000 --gpus 1 --model ViT-B-32 --batch 256 --steps 200 --timeout 120 --workers 8"
rates() { for m in /tmp/$1/runs/*/metrics.jsonl; do python3 -c "
import json, sys
rows=[json.loads(l) for l in open(sys.argv[1])]
print([(r.get('step'), round(r['samples_per_s_per_gpu']), round(r.get('data_wait_fraction', 0), 2)) for r in rows if 'samples_per_s_per_gpu' in r]); print(rows[0].get('startup_s'))" $m; done
  mkdir -p /tmp/keep/$1; cp /tmp/$1/*.log /tmp/$1/jpeg_data.json /tmp/$1/runs/*/metrics.jsonl /tmp/keep/$1/ 2>/dev/null; keep; }
for d in syn new1 old1 new2; do mkdir -p /tmp/$d && ln -sf /tmp/jpeg/shards /tmp/$d/shards; done
echo "== synthetic $(date +%T)"; python3 benchmarks/jpeg_data.py --out /tmp/syn $J --sides synthetic 2>&1 | grep "^| s"; rates syn
echo "== new1 $(date +%T)"; python3 benchmarks/jpeg_data.py --out /tmp/new1 $J --sides mixed 2>&1 | grep "^| m"; rates new1
echo "== old1 $(date +%T)"; (cd old && PYTHONPATH=/tmp/site:$PWD python3 benchmarks/jpeg_data.py --out /tmp/old1 $J --sides mixed 2>&1 | grep "^| m"); rates old1
echo "== new2 $(date +%T)"; python3 benchmarks/jpeg_data.py --out /tmp/new2 $J --sides mixed 2>&1 | grep "^| m"; rates new2
echo "end $(date +%T)"

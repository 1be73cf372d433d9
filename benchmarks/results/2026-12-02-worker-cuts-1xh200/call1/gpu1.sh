# Session 12, call 1 (issue #15): where a 'mixed' worker's time goes on the GPU host, how the workers scale,
# the pooled buffers (5061a47) beside 02dbd4f, py-spy of the workers, a long epoch (64 shards, 200 steps).
source setup.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-test/*.whl
mkdir -p /tmp/keep && cp gpu1.sh parts.py /tmp/keep/
keep() { tar -czf $OUT/call1.tgz -C /tmp/keep .; }
echo "start $(date +%T)"; nproc; lscpu | grep -E "Model name|^CPU\(s\)|Thread|Core|Socket|MHz|NUMA node\(s\)|L3"
python3 - > /tmp/keep/shards.txt 2>&1 <<'PY' &
import sys, time; sys.path.insert(0, "benchmarks")
from pathlib import Path
from jpeg_data import write_shards
t = time.time(); print(write_shards(Path("/tmp/jpeg/shards"), 64, 1000, 256), round(time.time() - t, 1), "s", flush=True)
PY
SHARDS=$!
echo "== CUDA tests $(date +%T)"; python3 -m pytest -q -p no:cacheprovider tests/test_decode.py 2>&1 | tail -3 | tee /tmp/keep/tests.txt
wait $SHARDS; cat /tmp/keep/shards.txt; keep
echo "== parts in one process $(date +%T)"; python3 parts.py /tmp/jpeg/shards 2>&1 | grep -v Warn | tee /tmp/keep/parts.txt; keep
U="--urls /tmp/jpeg/shards/{000000..000031}.tar --samples 32000 --decode mixed --batches 60 --skip 20"
echo "== scaling $(date +%T)"; python3 benchmarks/data_rate.py $U --workers 1 4 8 12 16 --out /tmp/keep/scaling.json 2>&1 | grep -E "^\|" | tee /tmp/keep/scaling.txt; keep
for t in new old old new; do
  echo "== pool A/B $t $(date +%T)"
  if [ $t = new ]; then python3 benchmarks/data_rate.py $U --workers 8 2>&1 | grep -E "^\|" | tee -a /tmp/keep/pool_$t.txt
  else (cd old && PYTHONPATH=/tmp/site:$PWD python3 benchmarks/data_rate.py $U --workers 8 2>&1 | grep -E "^\|" | tee -a /tmp/keep/pool_$t.txt); fi
done; keep
echo "== py-spy workers $(date +%T)"
python3 -m pip show py-spy >/dev/null 2>&1; SPY=/tmp/site/bin/py-spy
$SPY record --subprocesses --nonblocking --format raw -r 50 -o /tmp/keep/workers.raw -- python3 benchmarks/data_rate.py $U --workers 8 2>&1 | grep -E "^\||Error|error" | tail -5; keep
J="--shards 64 --per-shard 1000 --gpus 1 --model ViT-B-32 --batch 256 --steps 200 --timeout 120 --workers 8"
rates() { for m in /tmp/$1/runs/*/metrics.jsonl; do python3 -c "
import json, sys
rows=[json.loads(l) for l in open(sys.argv[1])]
print([(r.get('step'), round(r['samples_per_s_per_gpu']), round(r.get('data_wait_fraction', 0), 2)) for r in rows if 'samples_per_s_per_gpu' in r]); print(rows[0].get('startup_s'))" $m; done
  mkdir -p /tmp/keep/$1; cp /tmp/$1/*.log /tmp/$1/jpeg_data.json /tmp/$1/runs/*/metrics.jsonl /tmp/keep/$1/ 2>/dev/null; keep; }
for d in syn spy; do mkdir -p /tmp/$d && ln -sf /tmp/jpeg/shards /tmp/$d/shards; done
echo "== synthetic $(date +%T)"; python3 benchmarks/jpeg_data.py --out /tmp/syn $J --sides synthetic 2>&1 | grep "^| s"; rates syn
echo "== mixed under py-spy $(date +%T)"
$SPY record --subprocesses --nonblocking --format raw -r 50 -o /tmp/keep/train.raw -- python3 benchmarks/jpeg_data.py --out /tmp/spy $J --sides mixed 2>&1 | grep "^| m"; rates spy
echo "end $(date +%T)"

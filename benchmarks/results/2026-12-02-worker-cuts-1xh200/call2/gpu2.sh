# Session 12, call 2 (issue #15): where a 'mixed' worker's time goes on the GPU host: the worker's pipeline in
# one process (timed, then under cProfile), py-spy of the real DataLoader workers (1 and 8), and the pooled
# buffers (5061a47, "new") beside 02dbd4f ("old"), data_rate.py 8 workers, in the order new, old, old, new.
source setup.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/spy .whl-test/*.whl
SPY=/tmp/spy/bin/py-spy; export PYTHONPATH=$PYTHONPATH:/tmp/spy
mkdir -p /tmp/keep && cp gpu2.sh worker_profile_inprocess.py /tmp/keep/
keep() { tar -czf $OUT/call2.tgz -C /tmp/keep .; }
echo "start $(date +%T)"; ls $SPY
python3 - <<'PY'
import sys, time; sys.path.insert(0, "benchmarks")
from pathlib import Path
from jpeg_data import write_shards
t = time.time(); print(write_shards(Path("/tmp/jpeg/shards"), 32, 1000, 256), round(time.time() - t, 1), "s", flush=True)
PY
echo "== in one process $(date +%T)"
python3 worker_profile_inprocess.py 12 2>&1 | tail -1 | tee /tmp/keep/inprocess.txt
python3 worker_profile_inprocess.py 12 2>&1 | tail -1 | tee -a /tmp/keep/inprocess.txt
python3 worker_profile_inprocess.py 6 --profile 2>&1 | grep -v Warn > /tmp/keep/inprocess_profile.txt; head -40 /tmp/keep/inprocess_profile.txt; keep
U="--urls /tmp/jpeg/shards/{000000..000031}.tar --samples 32000 --decode mixed --batches 60 --skip 20"
for t in new old old new; do
  echo "== pool A/B $t $(date +%T)"
  if [ $t = new ]; then python3 benchmarks/data_rate.py $U --workers 8 2>&1 | grep -E "^\{" | tee -a /tmp/keep/pool_$t.txt
  else (cd old && PYTHONPATH=/tmp/site:$PWD python3 benchmarks/data_rate.py $U --workers 8 2>&1 | grep -E "^\{" | tee -a /tmp/keep/pool_$t.txt); fi
done; keep
for w in 1 8; do
  echo "== py-spy $w workers $(date +%T)"
  $SPY record --subprocesses --nonblocking --format raw -r 100 -o /tmp/keep/workers$w.raw -- python3 benchmarks/data_rate.py $U --workers $w 2>&1 | grep -E "^\{|rror|py-spy" | tail -4; keep
done
echo "end $(date +%T)"

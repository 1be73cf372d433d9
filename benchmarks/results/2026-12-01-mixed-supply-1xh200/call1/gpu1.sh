# Session 9, call 1 (issue #15): 'mixed' with the copy and the resize on the pinning thread's stream and the
# resize in float16 (new tree) beside HEAD b31668f (old/: copy and float32 resize in the step's stream).
source setup.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl-test/*.whl
echo "start $(date +%T)"
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_decode.py 2>&1 | tail -3
python3 - <<'PY'
import sys, time; sys.path.insert(0, "benchmarks")
from pathlib import Path
from jpeg_data import write_shards
t = time.time(); print(write_shards(Path("/tmp/jpeg/shards"), 32, 1000, 256), round(time.time() - t, 1), "s", flush=True)
PY
U='/tmp/jpeg/shards/{000000..000031}.tar'
echo "== new data_rate $(date +%T)"
timeout 160 python3 benchmarks/data_rate.py --urls "$U" --samples 32000 --workers 8 --decode mixed gpu --batches 100 --skip 40 --parts --parts-busy-ms 42 2>&1 | grep "^{"
echo "== old data_rate (gpu parts: float32 resize) $(date +%T)"
(cd old && PYTHONPATH=/tmp/site:$PWD timeout 60 python3 benchmarks/data_rate.py --urls "$U" --samples 32000 --workers 8 --decode gpu --batches 30 --skip 10 --parts --parts-busy-ms 42 2>&1 | grep '"part"')
J="--shards 32 --per-shard 1000 --gpus 1 --model ViT-B-32 --batch 256 --steps 120 --timeout 120 --workers 8"
echo "== new synthetic,mixed $(date +%T)"
timeout 300 python3 benchmarks/jpeg_data.py --out /tmp/jpeg $J --sides synthetic,mixed 2>&1 | grep "^{\|^|"
mkdir -p /tmp/jpeg-old /tmp/jpeg-again && ln -sf /tmp/jpeg/shards /tmp/jpeg-old/shards && ln -sf /tmp/jpeg/shards /tmp/jpeg-again/shards
echo "== old mixed $(date +%T)"
(cd old && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 benchmarks/jpeg_data.py --out /tmp/jpeg-old $J --sides mixed 2>&1 | grep "^{\|^|")
echo "== new mixed again $(date +%T)"
timeout 150 python3 benchmarks/jpeg_data.py --out /tmp/jpeg-again $J --sides mixed 2>&1 | grep "^{\|^|" ; true
mkdir -p $OUT/j
for d in jpeg jpeg-old jpeg-again; do [ -d /tmp/$d/runs ] || continue; mkdir -p $OUT/j/$d; cp /tmp/$d/*.log /tmp/$d/jpeg_data.json $OUT/j/$d/ 2>/dev/null; for r in /tmp/$d/runs/*; do cp $r/metrics.jsonl $OUT/j/$d/$(basename $r)-metrics.jsonl; done; done
tar czf $OUT/j.tgz -C $OUT j && rm -rf $OUT/j
echo "end $(date +%T)"

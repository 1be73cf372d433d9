# Session 13, call 2 (issue #15): ViT-B-32 on 64 JPEG shards (200 steps, no epoch start) with the new default step
# (43a20b4: the patch embedding as a matmul, +13% synthetic in call 1), 'mixed' with 8 workers, beside
# open_clip_train 3.3.0 (its own data pipeline and DDP step, webdataset 0.2.86 in its own site) on the same
# shards with 8 workers, synthetic first; the CUDA tests of tests/test_decode.py while the shards are written.
source setup.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/ocsite .ocsite-whl/*.whl
mkdir -p /tmp/keep && cp gpu2.sh /tmp/keep/
keep() { tar -czf $OUT/call2.tgz -C /tmp/keep .; }
echo "start $(date +%T)"; lscpu | grep -E "^(Model name|Thread|Core|Socket|CPU\(s\))" | tee /tmp/keep/lscpu.txt
python3 - > /tmp/keep/shards.txt 2>&1 <<'PY' &
import sys, time; sys.path.insert(0, "benchmarks")
from pathlib import Path
from jpeg_data import write_shards
t = time.time(); print(write_shards(Path("/tmp/jpeg/shards"), 64, 1000, 256), round(time.time() - t, 1), "s", flush=True)
PY
SHARDS=$!
echo "== CUDA tests $(date +%T)"; python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pt .whl-test/*.whl
PYTHONPATH=$PYTHONPATH:/tmp/pt python3 -m pytest -q -p no:cacheprovider tests/test_decode.py 2>&1 | tail -3 | tee /tmp/keep/tests.txt
wait $SHARDS; cat /tmp/keep/shards.txt; keep
J="--shards 64 --per-shard 1000 --gpus 1 --model ViT-B-32 --batch 256 --steps 200 --timeout 150 --workers 8"
rates() { for m in /tmp/$1/runs/*/metrics.jsonl; do python3 -c "
import json, sys
rows=[json.loads(l) for l in open(sys.argv[1])]
print([(r.get('step'), round(r['samples_per_s_per_gpu']), round(r.get('data_wait_fraction', 0), 2)) for r in rows if 'samples_per_s_per_gpu' in r]); print(rows[0].get('startup_s'))" $m; done
  mkdir -p /tmp/keep/$1; cp /tmp/$1/*.log /tmp/$1/jpeg_data.json /tmp/$1/runs/*/metrics.jsonl /tmp/keep/$1/ 2>/dev/null; keep; }
for d in syn mixed1 oct mixed2; do mkdir -p /tmp/$d && ln -sf /tmp/jpeg/shards /tmp/$d/shards; done
echo "== synthetic $(date +%T)"; python3 benchmarks/jpeg_data.py --out /tmp/syn $J --sides synthetic 2>&1 | grep "^| s"; rates syn
echo "== mixed1 $(date +%T)"; python3 benchmarks/jpeg_data.py --out /tmp/mixed1 $J --sides mixed 2>&1 | grep "^| m"; rates mixed1
echo "== open_clip_train $(date +%T)"; python3 benchmarks/jpeg_data.py --out /tmp/oct $J --sides open_clip_train --openclip-site /tmp/ocsite 2>&1 | grep "^| o"
mkdir -p /tmp/keep/oct; cp /tmp/oct/openclip.log /tmp/oct/jpeg_data.json /tmp/keep/oct/ 2>/dev/null; grep -c "Train Epoch" /tmp/oct/openclip.log; grep "Train Epoch" /tmp/oct/openclip.log | tail -2 | cut -c1-250; keep
echo "== mixed2 $(date +%T)"; python3 benchmarks/jpeg_data.py --out /tmp/mixed2 $J --sides mixed 2>&1 | grep "^| m"; rates mixed2
echo "end $(date +%T)"

# Session 8, call 2 (issue #15): ViT-B-32 training on real JPEG shards (decode gpu), this tree (its own tar
# reader, fsdpclip.tarshards) beside the previous commit's (webdataset's tarfile reader) at 8 workers and
# the previous one at 16 workers; the host's CPU use over each run; the pipeline alone with the new reader.
# Then the eager-vs-graphed worker on the final graph code.
source setup.sh
echo "start $(date +%T)"
busy() { awk '/^cpu /{print $2+$3+$4+$7+$8, $2+$3+$4+$5+$6+$7+$8}' /proc/stat; }
measure() {  # label, command...: runs it, prints the host's busy share of its 16 cores over the run
  local label=$1; shift; local a b; a=$(busy); "$@"; b=$(busy)
  echo "$label host CPU busy: $(echo "$a $b" | awk '{printf "%.1f%%", 100*($3-$1)/($4-$2)}')"
}
python3 - <<'PY'
import sys, time; sys.path.insert(0, "benchmarks")
from pathlib import Path
from jpeg_data import write_shards
t = time.time(); print(write_shards(Path("/tmp/jpeg/shards"), 32, 1000, 256), round(time.time() - t, 1), "s", flush=True)
PY
mkdir -p $OUT/r; for d in new8 old8 old16 synthetic; do mkdir -p /tmp/$d && ln -sfn /tmp/jpeg/shards /tmp/$d/shards; done
J="--shards 32 --per-shard 1000 --gpus 1 --model ViT-B-32 --batch 256 --steps 100 --timeout 100"
measure new-gpu8 timeout 130 python3 benchmarks/jpeg_data.py --out /tmp/new8 $J --workers 8 --sides gpu 2>&1 | grep -E "^\{|busy"
(cd old && export PYTHONPATH=/tmp/site:$PWD && measure old-gpu8 timeout 130 python3 benchmarks/jpeg_data.py --out /tmp/old8 $J --workers 8 --sides gpu 2>&1 | grep -E "^\{|busy")
(cd old && export PYTHONPATH=/tmp/site:$PWD && measure old-gpu16 timeout 130 python3 benchmarks/jpeg_data.py --out /tmp/old16 $J --workers 16 --sides gpu 2>&1 | grep -E "^\{|busy")
measure new-synthetic timeout 130 python3 benchmarks/jpeg_data.py --out /tmp/synthetic $J --workers 8 --sides synthetic 2>&1 | grep -E "^\{|busy"
measure new-pipeline timeout 100 python3 benchmarks/data_rate.py --urls '/tmp/jpeg/shards/{000000..000031}.tar' --samples 32000 \
  --workers 8 --decode gpu --batches 100 --skip 40 --out $OUT/r/rates.jsonl 2>&1 | grep -v Warning | tail -3
for a in 1 2; do timeout 120 python3 -m torch.distributed.run --standalone --nproc-per-node=1 tests/workers/cuda_graph.py /tmp/cg$a $a 2>&1 | grep "^{" | tail -1; done
mkdir -p $OUT/j; for d in /tmp/new8 /tmp/old8 /tmp/old16 /tmp/synthetic; do n=$(basename $d); for f in $d/*.log; do cp $f $OUT/j/$n-$(basename $f); done; cp $d/jpeg_data.json $OUT/j/$n-jpeg_data.json; for r in $d/runs/*; do cp $r/metrics.jsonl $OUT/j/$n-$(basename $r)-metrics.jsonl; done; done
tar czf $OUT/j.tgz -C $OUT j && rm -rf $OUT/j
echo "end $(date +%T)"

# Session 7, call 4: ViT-H-14 64/GPU beside compiled DDP (graphs off / default = whole towers + graphs);
# then ViT-bigG-14 through `fsdpclip launch` with today's defaults (compile per block + cuda_graph), a cold
# and a warm inductor cache: launch -> first step, and the rate after the capture.
source setup.sh
echo "start $(date +%T)"
mkdir -p $OUT/r /tmp/jp
timeout 220 torchrun --standalone --nproc-per-node=1 benchmarks/sidebyside.py --model ViT-H-14 --batch 64 --ddp compile \
  --warmup 4 --steps 15 --variants '{"graphs off": {"cuda_graph": false}, "default": {}}' --out $OUT/r/h14.jsonl > $OUT/r/h14.txt 2>&1
echo "h14 rc=$?"; grep "bs64" $OUT/r/h14.txt || tail -30 $OUT/r/h14.txt
python3 -c "
import json
job = {'run': {'name': 'bigg', 'output_dir': '/tmp/jp/runs'}, 'model': {'name': 'ViT-bigG-14'},
       'schedule': {'kind': 'constant', 'steps': 25}, 'batch': {'per_gpu': 32}, 'data': {'source': 'synthetic'},
       'checkpoint': {'at_end': False, 'resume': None}, 'logging': {'every_steps': 10},
       'launch': {'gpus_per_node': 1, 'env': {'TORCHINDUCTOR_CACHE_DIR': '/tmp/jp/inductor'}}}
open('/tmp/jp/bigg.json', 'w').write(json.dumps(job))"
for tag in cold warm; do
  rm -rf /tmp/jp/runs/bigg; t0=$(date +%s.%N)
  timeout -k 10 160 python3 -m fsdpclip launch /tmp/jp/bigg.json > $OUT/r/bigg-$tag.log 2>&1
  echo "bigg-$tag rc $? $(date +%T)"
  cp /tmp/jp/runs/bigg/metrics.jsonl $OUT/r/bigg-$tag-metrics.jsonl 2>/dev/null
  python3 -c "
import json
for line in open('/tmp/jp/runs/bigg/metrics.jsonl'):
    r = json.loads(line)
    if 'startup_s' in r: print('$tag', 'first step', round(r['time_to_first_step_s'], 1), 'cmd', round(r['time'] - $t0, 1), {k: round(v, 1) for k, v in r['startup_s'].items()})
    print('$tag', {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k not in ('startup_s', 'lr', 'total_steps', 'time')})" 2>&1 | tail -5
  grep -v "^W1201" $OUT/r/bigg-$tag.log | grep -m8 "auto\|CUDA graph\|Error\|error"
done
echo "end $(date +%T)"
tar czf $OUT/r.tgz -C $OUT r

source setup.sh
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv; nproc
echo "start $(date +%T)"
timeout -k 10 580 python3 benchmarks/throughput.py --gpus 2 --cases ViT-bigG-14:32 \
  --variants '{"fsdpclip": {}, "fsdpclip, blocks compiled": {"compile": true}}' \
  --ddp eager,compile --timeout 560 --out $OUT/t > $OUT/console.txt 2>&1
echo "rc $? end $(date +%T)"
cat $OUT/t/throughput.jsonl 2>/dev/null | python3 -c "
import sys,json
for l in sys.stdin:
  r=json.loads(l); print(r.get('model'),r.get('batch_per_gpu'),r.get('gpus'),r.get('variant'),r.get('samples_per_s_per_gpu'),r.get('mfu'),r.get('peak_memory_gib'),r.get('error'))"
grep -E "bs32|compile 'auto'|Error|error" $OUT/t/*.log | tail -8
rm -f $OUT/t/*.png

source setup.sh
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv; nproc
echo "start $(date +%T)"
timeout -k 10 575 python3 benchmarks/throughput.py --gpus 2 --cases ViT-B-32:256 ViT-L-14:128 ViT-H-14:64 \
  --ddp eager,compile --timeout 260 --out $OUT/t > $OUT/console.txt 2>&1
echo "rc $? end $(date +%T)"
cat $OUT/t/throughput.jsonl 2>/dev/null | python3 -c "
import sys,json
for l in sys.stdin:
  r=json.loads(l); print(r.get('model'),r.get('batch_per_gpu'),r.get('gpus'),r.get('variant'),r.get('samples_per_s_per_gpu'),r.get('mfu'),r.get('peak_memory_gib'),r.get('error'))"
tail -5 $OUT/console.txt

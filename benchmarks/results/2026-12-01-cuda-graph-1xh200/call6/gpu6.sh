# Session 7, call 6: ViT-B-32 on real JPEG shards with the graphed step (today's defaults): synthetic,
# data.decode gpu and cpu, 8 workers, 1×H200, 100 steps each.
source setup.sh
echo "start $(date +%T)"
timeout 300 python3 benchmarks/jpeg_data.py --out /tmp/jpeg --shards 32 --per-shard 1000 --gpus 1 --model ViT-B-32 \
  --batch 256 --workers 8 --steps 100 --sides synthetic,gpu,cpu --timeout 90 2>&1 | tail -25
mkdir -p $OUT/j && cp /tmp/jpeg/*.log /tmp/jpeg/jpeg_data.json $OUT/j/ 2>/dev/null; for d in /tmp/jpeg/runs/*; do cp $d/metrics.jsonl $OUT/j/$(basename $d)-metrics.jsonl; done
tar czf $OUT/j.tgz -C $OUT j && rm -rf $OUT/j
echo "end $(date +%T)"

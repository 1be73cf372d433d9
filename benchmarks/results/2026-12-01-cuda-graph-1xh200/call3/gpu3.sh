# Session 7, call 3: the capture writing fresh gradients (no persistent ones): parity again (accum 1, 2);
# ViT-B-32 256 beside compiled DDP; ViT-bigG-14 32 beside eager DDP (memory).
source setup.sh
echo "start $(date +%T)"
mkdir -p $OUT/r
for accum in 1 2; do
  timeout 200 torchrun --standalone --nproc-per-node=1 tests/workers/cuda_graph.py /tmp/cg$accum $accum > $OUT/r/worker-accum$accum.txt 2>&1
  echo "worker accum $accum rc=$?"; grep '^{' $OUT/r/worker-accum$accum.txt || tail -30 $OUT/r/worker-accum$accum.txt
done
timeout 200 torchrun --standalone --nproc-per-node=1 benchmarks/sidebyside.py --model ViT-B-32 --batch 256 --ddp compile \
  --variants '{"graphs off": {"cuda_graph": false}, "default": {}}' --out $OUT/r/b32.jsonl > $OUT/r/b32.txt 2>&1
echo "b32 rc=$?"; grep "bs256" $OUT/r/b32.txt || tail -30 $OUT/r/b32.txt
timeout 300 torchrun --standalone --nproc-per-node=1 benchmarks/sidebyside.py --model ViT-bigG-14 --batch 32 --ddp eager \
  --warmup 4 --steps 12 --variants '{"default": {}, "graphs": {"cuda_graph": true}, "compiled blocks + graphs": {"compile": true, "cuda_graph": true}}' \
  --out $OUT/r/bigg.jsonl > $OUT/r/bigg.txt 2>&1
echo "bigg rc=$?"; grep "bs32" $OUT/r/bigg.txt || tail -30 $OUT/r/bigg.txt
echo "end $(date +%T)"
tar czf $OUT/r.tgz -C $OUT r

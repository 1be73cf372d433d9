# Session 7, call 1: fsdp.cuda_graph on 1×H200. (a) tests/workers/cuda_graph.py: eager vs graphed tiny model,
# losses and parameters, grad_accum 1 and 2. (b) sidebyside ViT-B-32 256 and ViT-L-14 128 beside compiled DDP:
# graphs off / default (graphs on where 'auto' says) / per-tower units resharded + graphs (torchtitan's failing case).
source setup.sh
nproc; echo "start $(date +%T)"; python3 -c "import torch; print(torch.__version__)"
mkdir -p $OUT/r
for accum in 1 2; do
  timeout 200 torchrun --standalone --nproc-per-node=1 tests/workers/cuda_graph.py /tmp/cg$accum $accum > $OUT/r/worker-accum$accum.txt 2>&1
  echo "worker accum $accum rc=$?"; grep '^{' $OUT/r/worker-accum$accum.txt || tail -30 $OUT/r/worker-accum$accum.txt
done
echo "workers done $(date +%T)"
V='{"graphs off": {"cuda_graph": false}, "default": {}, "units resharded + graphs": {"compile": false, "cuda_graph": true}}'
timeout 200 torchrun --standalone --nproc-per-node=1 benchmarks/sidebyside.py --model ViT-B-32 --batch 256 --ddp compile \
  --variants "$V" --out $OUT/r/b32.jsonl > $OUT/r/b32.txt 2>&1; echo "b32 rc=$?"; grep "bs256" $OUT/r/b32.txt || tail -30 $OUT/r/b32.txt
echo "b32 done $(date +%T)"
timeout 230 torchrun --standalone --nproc-per-node=1 benchmarks/sidebyside.py --model ViT-L-14 --batch 128 --ddp compile \
  --variants '{"graphs off": {"cuda_graph": false}, "default": {}}' --out $OUT/r/l14.jsonl > $OUT/r/l14.txt 2>&1; echo "l14 rc=$?"; grep "bs128" $OUT/r/l14.txt || tail -30 $OUT/r/l14.txt
echo "end $(date +%T)"
grep -h "CUDA graph\|cuda_graph\|Error\|error" $OUT/r/*.txt | sort | uniq -c | head -20
tar czf $OUT/r.tgz -C $OUT r

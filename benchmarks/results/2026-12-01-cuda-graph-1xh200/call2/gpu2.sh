# Session 7, call 2: ViT-B-32 at 512/GPU beside compiled DDP (graphs off / default = graphs on);
# ViT-bigG-14 at 32/GPU beside eager DDP: default (eager blocks, resharded; cuda_graph 'auto' off there),
# cuda_graph true, compile per block + cuda_graph true.
source setup.sh
echo "start $(date +%T)"
mkdir -p $OUT/r
timeout 230 torchrun --standalone --nproc-per-node=1 benchmarks/sidebyside.py --model ViT-B-32 --batch 512 --ddp compile \
  --variants '{"graphs off": {"cuda_graph": false}, "default": {}}' --out $OUT/r/b32-512.jsonl > $OUT/r/b32-512.txt 2>&1
echo "b32 rc=$?"; grep "bs512" $OUT/r/b32-512.txt || tail -30 $OUT/r/b32-512.txt
echo "b32 done $(date +%T)"
timeout 330 torchrun --standalone --nproc-per-node=1 benchmarks/sidebyside.py --model ViT-bigG-14 --batch 32 --ddp eager \
  --warmup 4 --steps 12 --variants '{"default": {}, "graphs": {"cuda_graph": true}, "compiled blocks + graphs": {"compile": true, "cuda_graph": true}}' \
  --out $OUT/r/bigg.jsonl > $OUT/r/bigg.txt 2>&1
echo "bigg rc=$?"; grep "bs32" $OUT/r/bigg.txt || tail -30 $OUT/r/bigg.txt
echo "end $(date +%T)"
tar czf $OUT/r.tgz -C $OUT r

# Session 13, call 3 (issue #14): the patch embedding as a matmul (43a20b4) beside OpenCLIP's convolution in the
# default step of the larger models (sidebyside.py, 1×H200, DDP in the same process) and ViT-B-32 at 512/GPU;
# then which eager ops of ViT-B-32's step take device time (reduce_probe.py).
source setup.sh
mkdir -p $OUT/r
V='{"default": {}, "conv patches": {"direct_patch_embedding": false}}'
run1() { # model batch ddp timeout
  echo "=== $1 $2 $(date +%T)"
  timeout -k 10 $4 python3 -m torch.distributed.run --standalone --nproc-per-node=1 benchmarks/sidebyside.py \
     --model $1 --batch $2 --variants "$V" --ddp $3 --warmup 5 --steps 20 --out $OUT/r/rows.jsonl \
     > $OUT/r/$1-$2.log 2>&1
  echo "rc $?"; grep -E "bs$2 " $OUT/r/$1-$2.log
}
run1 ViT-H-14 64 compile 200
run1 ViT-bigG-14 32 eager 180
run1 ViT-B-32 512 compile 130
echo "== reduce probe $(date +%T)"
timeout -k 5 60 python3 -m torch.distributed.run --standalone --nproc-per-node=1 reduce_probe.py > $OUT/r/reduce_probe.txt 2>&1
echo "rc $?"; grep " ms " $OUT/r/reduce_probe.txt
echo "end $(date +%T)"

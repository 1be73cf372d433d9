# Session 13, call 1 (issue #14): the patch embedding as a matmul (43a20b4) beside OpenCLIP's convolution, alone
# (patch_probe.py) and in the default step (sidebyside.py, 1×H200, compiled DDP in the same process), and where
# the default step's device time goes now (the graphed step, profiled).
source setup.sh
mkdir -p $OUT/r
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; nproc
echo "== probe $(date +%T)"; python3 patch_probe.py 2>&1 | tee $OUT/r/probe.txt
V='{"default": {}, "conv patches": {"direct_patch_embedding": false}}'
run1() { # model batch ddp timeout
  echo "=== $1 $2 $(date +%T)"
  timeout -k 10 $4 python3 -m torch.distributed.run --standalone --nproc-per-node=1 benchmarks/sidebyside.py \
     --model $1 --batch $2 --variants "$V" --ddp $3 --warmup 5 --steps 20 --profile default --out $OUT/r/rows.jsonl \
     > $OUT/r/$1-$2.log 2>&1
  echo "rc $?"; grep -E "bs$2 |device time" $OUT/r/$1-$2.log
}
run1 ViT-B-32 256 compile 170
run1 ViT-L-14 128 compile 230
echo "end $(date +%T)"

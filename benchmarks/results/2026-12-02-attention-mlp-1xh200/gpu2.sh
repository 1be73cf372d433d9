# Session 14, call 2 (issue #14): inductor's split size for LayerNorm's backward partial sums (mix-order
# reduction) in the default step, side by side in one process per model (sidebyside.py, --ddp none, 1×H200):
# inductor's own (16 rows here), 32, 64, 128, and the mix-order reduction off.
source setup.sh
mkdir -p $OUT/r
o() { echo "{\"compile_options\": {\"triton.mix_order_reduction_split_size\": $1}}"; }
V5="{\"split 16 (inductor's)\": $(o null), \"split 32\": $(o 32), \"split 64\": $(o 64), \"split 128\": $(o 128),
     \"no mix-order\": {\"compile_options\": {\"triton.mix_order_reduction\": false}}}"
V3="{\"split 16 (inductor's)\": $(o null), \"split 64\": $(o 64), \"split 128\": $(o 128)}"
V2="{\"split 16 (inductor's)\": $(o null), \"split 64\": $(o 64)}"
run1() { # model batch variants timeout [variant to profile]
  echo "=== $1 $2 $(date +%T)"
  timeout -k 10 $4 python3 -m torch.distributed.run --standalone --nproc-per-node=1 benchmarks/sidebyside.py \
     --model $1 --batch $2 --variants "$3" --ddp none --warmup 5 --steps 30 --out $OUT/r/rows.jsonl --profile "$5" \
     > $OUT/r/$1-$2.log 2>&1
  echo "rc $?"; grep -E "bs$2 |device time" $OUT/r/$1-$2.log
}
run1 ViT-B-32 256 "$V5" 230 "split 64"
run1 ViT-L-14 128 "$V3" 220
run1 ViT-H-14 64 "$V2" 130
echo "end $(date +%T)"

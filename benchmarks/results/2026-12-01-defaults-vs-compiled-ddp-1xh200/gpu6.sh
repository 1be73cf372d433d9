source setup.sh
mkdir -p $OUT/r
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv; nproc
run1() { # model batch variants ddp timeout profile
  echo "=== $1 $2 $(date +%T)"
  timeout -k 10 $5 python3 -m torch.distributed.run --standalone --nproc-per-node=1 benchmarks/sidebyside.py \
     --model $1 --batch $2 --variants "$3" --ddp $4 --warmup 5 --steps 15 --profile $6 --out $OUT/r/rows.jsonl \
     > $OUT/r/$1-$2-$6.log 2>&1
  echo "rc $?"; grep -E "bs$2 |device time|compile 'auto'" $OUT/r/$1-$2-$6.log | tail -8
}
run1 ViT-B-32 256 '{"default":{}}' compile 120 none
run1 ViT-H-14 64 '{"default":{}}' compile 230 none
run1 ViT-L-14 128 '{"default":{}}' compile 190 none
echo "end $(date +%T)"

source setup.sh
mkdir -p $OUT/r
run1() { # model batch variants ddp timeout profile tag
  echo "=== $1 $2 $7 $(date +%T)"
  timeout -k 10 $5 python3 -m torch.distributed.run --standalone --nproc-per-node=1 benchmarks/sidebyside.py \
     --model $1 --batch $2 --variants "$3" --ddp $4 --warmup 5 --steps 15 --profile $6 --out $OUT/r/rows.jsonl \
     > $OUT/r/$1-$2-$7.log 2>&1
  echo "rc $?"; grep -E "bs$2 |device time|compile 'auto'|Self CPU time" $OUT/r/$1-$2-$7.log | tail -8
}
run1 ViT-B-32 256 '{"default":{}}' none 90 default profile
run1 ViT-H-14 128 '{"default":{}}' compile 230 none mfu
echo "end $(date +%T)"

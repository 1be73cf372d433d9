source setup.sh
mkdir -p $OUT/r
run1() { # model batch variants ddp timeout profile tag
  echo "=== $1 $2 $7 $(date +%T)"
  timeout -k 10 $5 python3 -m torch.distributed.run --standalone --nproc-per-node=1 benchmarks/sidebyside.py \
     --model $1 --batch $2 --variants "$3" --ddp $4 --warmup 5 --steps 15 --profile $6 --out $OUT/r/rows.jsonl \
     > $OUT/r/$1-$2-$7.log 2>&1
  echo "rc $?"; grep -E "bs$2 |device time|compile 'auto'" $OUT/r/$1-$2-$7.log | tail -8
}
TOWERS='"wrap":{"image":["Transformer"],"text":["Transformer"]},"compile":true,"reshard_after_forward":true'
run1 ViT-bigG-14 32 '{"default":{}}' eager,compile 290 default ref
run1 ViT-bigG-14 32 "{\"blocks\":{\"compile\":true},\"towers-reshard\":{$TOWERS}}" eager 270 blocks compile
echo "end $(date +%T)"

# ViT-B-32 256/GPU on 1×H200: 13d7384 (old: clip_gradients with autograd on) and the clip fix (new), each in its own
# sidebyside process beside compiled DDP, alternating old/new/old/new.
source setup.sh
nproc; echo "start $(date +%T)"
mkdir -p $OUT/r
run1() { # tree tag
  if [ $1 = old ]; then d=$PWD/old; else d=$PWD; fi
  (cd $d && PYTHONPATH=/tmp/site:$d timeout -k 10 110 python3 -m torch.distributed.run --standalone --nproc-per-node=1 \
     benchmarks/sidebyside.py --model ViT-B-32 --batch 256 --variants "{\"$1\":{}}" --ddp compile --warmup 5 --steps 30 \
     --out $OUT/r/rows.jsonl > $OUT/r/$1-$2.log 2>&1)
  echo "$1-$2 rc $? $(date +%T)"; grep -E "bs256 " $OUT/r/$1-$2.log
}
export -f run1 2>/dev/null; run1 old 1; run1 new 1; run1 old 2; run1 new 2
echo "end $(date +%T)"

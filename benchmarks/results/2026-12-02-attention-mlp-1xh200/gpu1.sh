# Session 14, call 1 (issue #14): SDPA's backends at the models' attention shapes (attn_probe.py); row 48, the
# text towers' causal mask as is_causal, in ViT-B-32's default step (this tree beside the same tree with the
# rule off, alternating processes, --ddp none); compiled block containers under inductor settings
# (tower_probe.py: where the float32 sums come from, GELU's epilogue under max-autotune).
# Run from a tree with .whl/, setup.sh and old/ (the same tree, `module.mask_is_causal = True` replaced by `pass`).
source setup.sh
mkdir -p $OUT/r
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; nproc
echo "== attention $(date +%T)"; timeout -k 5 100 python3 attn_probe.py 2>&1 | tee $OUT/r/attn.txt | grep -v Warn
side() { # tree label
  echo "=== $2 $(date +%T)"
  (cd $1 && PYTHONPATH=/tmp/site:$PWD timeout -k 10 110 python3 -m torch.distributed.run --standalone \
     --nproc-per-node=1 benchmarks/sidebyside.py --model ViT-B-32 --batch 256 --variants "{\"$2\": {}}" \
     --ddp none --warmup 5 --steps 30 --out $OUT/r/rows.jsonl > $OUT/r/side-$2.log 2>&1)
  echo "rc $?"; grep -E "bs256 " $OUT/r/side-$2.log
}
side . causal-1; side old mask-1; side . causal-2; side old mask-2
tower() { echo "=== $1 $2 $(date +%T)"; timeout -k 5 $3 python3 tower_probe.py $1 $2 > $OUT/r/tower-$1-$2.log 2>&1;
          echo "rc $?"; grep -v Warn $OUT/r/tower-$1-$2.log | tail -8; }
tower B-32 default 90
tower L-14 default 90
tower B-32 no-split-reductions 90
tower L-14 max-autotune 200
tower L-14 coordinate-descent 120
echo "end $(date +%T)"

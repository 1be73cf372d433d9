"""Where py-spy's raw samples (record --format raw, gzipped or not) of DataLoader workers spend their time:
`python spy.py workers8.raw.gz`: self and inclusive shares of the worker processes' samples."""
import collections, gzip, re, sys
path = sys.argv[1]
procs = collections.Counter(); leaf = collections.Counter(); incl = collections.Counter(); total = 0
for line in (gzip.open if path.endswith(".gz") else open)(path, "rt", errors="replace"):
    line = line.rstrip("\n")
    stack, _, n = line.rpartition(" ")
    if not n.isdigit(): continue
    n = int(n)
    if "_worker_loop" not in stack: continue
    frames = [f for f in stack.split(";") if not f.startswith("process ")]
    total += n
    names = [re.sub(r" \(.*?([^/]+\.py):\d+\)$", r" (\1)", f) for f in frames]
    leaf[names[-1]] += n
    for f in set(names): incl[f] += n
print("worker samples", total)
print("--- self")
for k, v in leaf.most_common(25): print(f"{v / total:6.1%} {k}")
print("--- inclusive")
for k, v in incl.most_common(45): print(f"{v / total:6.1%} {k}")

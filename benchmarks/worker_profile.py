"""Per-sample host cost of the data workers' steps on one core: tar reading, JPEG decode, each step of
OpenCLIP's ViT-B-32 train transform, tokenising, and the per-sample RNG fork (fsdpclip.data seeds each
sample's augmentation). Writes one shard of 400 benchmark JPEGs (benchmarks/jpeg_data.py) first.

    python benchmarks/worker_profile.py
"""
import io, sys, time, torch
from pathlib import Path
sys.path.insert(0, "benchmarks")
torch.set_num_threads(1)
from jpeg_data import write_shard
d = Path("/tmp/profshard"); d.mkdir(exist_ok=True)
tar = d / "000000.tar"
if not tar.exists():
    write_shard((tar, 0, 400, 256))
import open_clip, webdataset as wds
from PIL import Image
pp = open_clip.image_transform(224, is_train=True)
tok = open_clip.get_tokenizer("ViT-B-32")
samples = [s for s in wds.WebDataset(str(tar), shardshuffle=False)]
n = len(samples)
def t(label, f):
    b = time.perf_counter(); [f(s) for s in samples]; dt = (time.perf_counter() - b) / n * 1e3
    print(f"{label:45s} {dt:.3f} ms/sample"); return dt
b = time.perf_counter(); list(wds.WebDataset(str(tar), shardshuffle=False)); print(f"{'read tar + group':45s} {(time.perf_counter()-b)/n*1e3:.3f} ms/sample")
t("PIL open + load (decode)", lambda s: Image.open(io.BytesIO(s["jpg"])).load())
imgs = [Image.open(io.BytesIO(s["jpg"])).convert("RGB") for s in samples]
i = iter(range(10**9))
print(pp)
steps = pp.transforms
def upto(k):
    def f(s):
        x = imgs[next(i) % n]
        for st in steps[:k]: x = st(x)
        return x
    return f
for k in range(1, len(steps)+1):
    t(f"transform steps[:{k}] ({type(steps[k-1]).__name__})", upto(k))
t("tokenize one caption", lambda s: tok([s["txt"].decode()]))
t("fork_rng + torch.manual_seed (before)", lambda s: (lambda: [None for _ in [torch.random.fork_rng(devices=[]).__enter__(), torch.manual_seed(1)]])())
t("fork_rng + default_generator.manual_seed (now)", lambda s: (lambda: [None for _ in [torch.random.fork_rng(devices=[]).__enter__(), torch.default_generator.manual_seed(1)]])())

"""Per-sample costs of one data worker's parts on this host, in one process, one thread (session 9, call 2)."""
import io, itertools, sys, time, os
from concurrent.futures import ThreadPoolExecutor
import numpy as np, torch
from PIL import Image
import PIL, PIL.features
from torchvision.io import decode_jpeg, ImageReadMode
from fsdpclip.data import ShardStream
from fsdpclip.decode import _crop
from fsdpclip.model import build_tokenizer, image_transform, model_config, model_from_config
from fsdpclip.spec import ModelSpec, WebDatasetSpec
from fsdpclip.tarshards import shard_samples
torch.set_num_threads(1)
urls = sys.argv[1]
first = urls.split("{")[0] + "000000.tar"
print("pillow", PIL.__version__, "features", PIL.features.version("libjpeg_turbo") if hasattr(PIL.features, "version") else "?", "cpus", os.cpu_count(), flush=True)
samples = list(itertools.islice(shard_samples(first, lambda e: False), 500))
jpgs = [s["jpg"] for s in samples]; caps = [s["txt"].decode() for s in samples]
config = model_config(ModelSpec(name="ViT-B-32")); tok = build_tokenizer(config)
model = model_from_config(config, device="meta"); tr = image_transform(model, train=True); crop = _crop(tr.transforms)
def t(name, f, n=len(jpgs)):
    f(0); a = time.perf_counter(); c = time.process_time()
    for i in range(n): f(i)
    print(f"{name:34s} {(time.perf_counter()-a)/n*1e3:.3f} ms/sample wall, {(time.process_time()-c)/n*1e3:.3f} cpu", flush=True)
t("read tar (x100: per 100 samples)", lambda i: list(itertools.islice(shard_samples(first, lambda e: False), 100)), 5)
t("PIL open", lambda i: Image.open(io.BytesIO(jpgs[i])))
t("PIL open+load", lambda i: Image.open(io.BytesIO(jpgs[i])).load())
t("PIL open+asarray", lambda i: np.asarray(Image.open(io.BytesIO(jpgs[i]))))
t("torchvision decode_jpeg (cpu)", lambda i: decode_jpeg(torch.frombuffer(bytearray(jpgs[i]), dtype=torch.uint8), mode=ImageReadMode.RGB))
im = Image.open(io.BytesIO(jpgs[0]))
t("RandomResizedCrop.get_params", lambda i: crop.get_params(im, crop.scale, crop.ratio))
t("tokenize one caption", lambda i: tok([caps[i]]))
for threads in (2, 4):
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda j: np.asarray(Image.open(io.BytesIO(j))), jpgs[:50]))
        a = time.perf_counter(); list(pool.map(lambda j: np.asarray(Image.open(io.BytesIO(j))), jpgs))
        print(f"PIL open+asarray, {threads} threads: {(time.perf_counter()-a)/len(jpgs)*1e3:.3f} ms/sample wall", flush=True)
for mode in ("mixed", "gpu", "cpu"):
    spec = WebDatasetSpec(urls=urls, samples=8000, workers=1, decode=mode)
    s = ShardStream(spec, tr, tok, 256, 0, 1, 0)
    it = s.worker_batches(0, 1); next(it)
    a = time.perf_counter(); c = time.process_time()
    for b in itertools.islice(it, 4): pass
    print(f"worker_batches decode={mode}: {(time.perf_counter()-a)/1024*1e3:.3f} ms/sample wall, {(time.process_time()-c)/1024*1e3:.3f} cpu", flush=True)

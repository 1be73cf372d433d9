"""A 'mixed' DataLoader worker's own clock, per batch: wall and CPU (thread_time) seconds spent making it, and
wall seconds blocked at its yield (the queue full). `python worker_clock.py SHARDS SAMPLES WORKERS BATCHES [gc]`:
gc 'freeze' or 'off' in the workers (default: as is). Prints ms per sample over each worker's batches after its
first 6 (a worker's first batches wait for its shuffle buffer)."""
import gc, itertools, json, os, statistics, sys, time, tempfile
import torch
import fsdpclip.data as data
from fsdpclip.decode import CroppedBatch
from fsdpclip.model import build_tokenizer, image_transform, model_config, model_from_config
from fsdpclip.spec import ModelSpec, WebDatasetSpec

urls, samples, workers, batches = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
mode = sys.argv[5] if len(sys.argv) > 5 and not sys.argv[5].startswith("--") else "default"
log_dir = tempfile.mkdtemp()
original = data.ShardStream.worker_batches

def clocked(self, logical, workers):
    if mode == "freeze":
        gc.freeze()
    elif mode == "off":
        gc.disable()
    rows = []
    wall, cpu = time.perf_counter(), time.thread_time()
    for batch in original(self, logical, workers):
        made_wall, made_cpu = time.perf_counter() - wall, time.thread_time() - cpu
        t = time.perf_counter()
        yield batch
        rows.append((made_wall, made_cpu, time.perf_counter() - t, dict(PARTS)))
        PARTS.clear()
        with open(f"{log_dir}/{os.getpid()}.json", "w") as f:
            json.dump(rows, f)
        wall, cpu = time.perf_counter(), time.thread_time()

data.ShardStream.worker_batches = clocked
PARTS = {}

def timed(owner, name, label):
    inner = getattr(owner, name, None)
    if inner is None:
        return
    def wrapper(*args, **kwargs):
        c = time.thread_time()
        try:
            return inner(*args, **kwargs)
        finally:
            PARTS[label] = PARTS.get(label, 0.0) + time.thread_time() - c
    setattr(owner, name, staticmethod(wrapper) if isinstance(owner, type) and name == "get_params" else wrapper)

import fsdpclip.decode as decode, PIL.Image
from torchvision.transforms import RandomResizedCrop
if "--parts" in sys.argv:
    timed(decode, "rgb_pixels", "decode (rgb_pixels)")
    timed(decode, "crop_box", "crop_box")
    timed(RandomResizedCrop, "get_params", "get_params")
    timed(data.ShardStream, "_collate", "collate")
    timed(data._Reader, "__next__", "read (tar, shuffle fill)")
    timed(PIL.Image, "open", "PIL open")
config = model_config(ModelSpec(name="ViT-B-32"))
model, tok = model_from_config(config, device="meta"), build_tokenizer(config)
if "--parts" in sys.argv:
    class Tok:
        def __call__(self, texts):
            c = time.thread_time()
            try:
                return tok(texts)
            finally:
                PARTS["tokenize"] = PARTS.get("tokenize", 0.0) + time.thread_time() - c
    tokenizer = Tok()
else:
    tokenizer = tok
spec = WebDatasetSpec(urls=urls, samples=samples, workers=workers, decode="mixed")
stream, images = data.webdataset_batches(spec, image_transform(model, train=True), tokenizer, 256, 0, 1, 0,
                                         torch.device("cpu"), pin_memory=False)
it = iter(stream)
t0 = time.perf_counter()
for pixels, texts in itertools.islice(it, batches):
    if isinstance(pixels, CroppedBatch):
        pixels.release()
total = time.perf_counter() - t0
it.close(); stream.close()
walls, cpus, blocked, parts = [], [], [], {}
for name in os.listdir(log_dir):
    rows = json.load(open(f"{log_dir}/{name}"))[6:]
    walls += [r[0] for r in rows]; cpus += [r[1] for r in rows]; blocked += [r[2] for r in rows]
    for r in rows:
        for k, v in r[3].items():
            parts.setdefault(k, []).append(v)
ms = lambda v: round(statistics.median(v) / 256 * 1e3, 3)
print(json.dumps({"workers": workers, "gc": mode, "batches": batches, "rank_samples_per_s": round(batches * 256 / total),
                  "worker_wall_ms_per_sample": ms(walls), "worker_cpu_ms_per_sample": ms(cpus),
                  "blocked_ms_per_sample": ms(blocked), "n": len(walls), "parts_cpu_ms_per_sample": {k: ms(v) for k, v in parts.items()}}))

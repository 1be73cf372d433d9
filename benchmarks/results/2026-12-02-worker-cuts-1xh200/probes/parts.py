"""Parts of a 'mixed' worker's work timed one by one in one process (ViT-B-32's transform and tokenizer):
`python parts.py SHARD_DIR` (shards 000000..000003.tar of benchmarks/jpeg_data.py there), ms per sample."""
import io, time, torch, sys
from PIL import Image
from fsdpclip.tarshards import shard_samples
from fsdpclip.model import model_config, model_from_config, build_tokenizer, image_transform
from fsdpclip.spec import ModelSpec
from fsdpclip.decode import TrainImages, _crop, rgb_pixels
torch.set_num_threads(1)
config = model_config(ModelSpec(name="ViT-B-32"))
model, tok = model_from_config(config, device="meta"), build_tokenizer(config)
images = TrainImages(image_transform(model, train=True), "mixed", torch.device("cpu"))
crop = _crop(images.worker_transform.transforms)
t = time.perf_counter()
samples = []
for i in range(4):
    samples += list(shard_samples(f"{sys.argv[1]}/00000{i}.tar", lambda e: True))
n = len(samples); T = {}
T["tar"] = time.perf_counter() - t
def timed(name, f):
    t = time.perf_counter(); out = [f(s) for s in samples]; T[name] = time.perf_counter() - t; return out
opened = timed("Image.open", lambda s: Image.open(io.BytesIO(s["jpg"])))
def forked(s):
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(12345)
timed("fork_rng+seed", forked)
ims = iter(opened)
timed("get_params", lambda s: crop.get_params(next(ims), crop.scale, crop.ratio))
ims = iter(opened)
timed("rgb_pixels", lambda s: rgb_pixels(s["jpg"], next(ims)))
timed("decode_jpeg bare", lambda s: torch.ops.image.decode_jpeg(torch.frombuffer(s["jpg"], dtype=torch.uint8), 3, False))
timed("caption utf8", lambda s: s["txt"].decode())
timed("tokenize", lambda s: tok([s["txt"].decode()])[0])
for k, v in T.items(): print(f"{k:20s} {v / n * 1e3:.4f} ms/sample")
from torchvision.io import decode_jpeg, ImageReadMode
from fsdpclip.decode import whole_rgb_jpeg
T.clear()
for rep in range(2):
    ims = iter(opened)
    timed("rgb_pixels", lambda s: rgb_pixels(s["jpg"], next(ims)))
    timed("decode_jpeg bare", lambda s: torch.ops.image.decode_jpeg(torch.frombuffer(s["jpg"], dtype=torch.uint8), 3, False))
    timed("tv decode_jpeg", lambda s: decode_jpeg(torch.frombuffer(bytearray(s["jpg"]), dtype=torch.uint8), mode=ImageReadMode.RGB))
    ims = iter(opened)
    timed("whole_rgb_jpeg", lambda s: whole_rgb_jpeg(s["jpg"], next(ims)))
    timed("bytearray", lambda s: torch.frombuffer(bytearray(s["jpg"]), dtype=torch.uint8))
    for k, v in T.items(): print(f"{k:20s} {v / n * 1e3:.4f} ms/sample")

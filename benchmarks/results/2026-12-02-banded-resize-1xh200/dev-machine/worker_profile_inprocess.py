"""One 'mixed' worker's pipeline in one process (ShardStream.worker_batches, ViT-B-32's transform and tokenizer),
256-px JPEG shards of benchmarks/jpeg_data.py at /tmp/jpegdev/shards (4 shards of 1000): ms per sample, and with
--profile the cProfile table. Run from a tree of fsdpclip: `python3 worker_profile_inprocess.py 6 [--profile]`."""
import cProfile, pstats, sys, time, torch
sys.path.insert(0, "benchmarks")
from fsdpclip.data import ShardStream
from fsdpclip.decode import TrainImages
from fsdpclip.model import model_config, model_from_config, build_tokenizer, image_transform
from fsdpclip.spec import ModelSpec, WebDatasetSpec
torch.set_num_threads(1)
config = model_config(ModelSpec(name="ViT-B-32"))
model, tok = model_from_config(config, device="meta"), build_tokenizer(config)
images = TrainImages(image_transform(model, train=True), "mixed", torch.device("cpu"))
spec = WebDatasetSpec(urls="/tmp/jpegdev/shards/{000000..000003}.tar", samples=4000, workers=1, decode="mixed")
stream = ShardStream(spec, images.worker_transform, tok, 256, rank=0, world_size=1, seed=0)
it = stream.worker_batches(0, 1)
next(it)  # fill the shuffle buffer
t = time.perf_counter(); n = int(sys.argv[1]) if len(sys.argv) > 1 else 6
if "--profile" in sys.argv:
    pr = cProfile.Profile(); pr.enable()
for _ in range(n): next(it)
dt = time.perf_counter() - t
if "--profile" in sys.argv:
    pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(25)
print(f"{dt / (n * 256) * 1e3:.3f} ms/sample over {n} batches")

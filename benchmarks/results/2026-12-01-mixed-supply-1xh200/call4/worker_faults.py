"""One 'mixed' worker in one process on this host: ms and minor page faults per sample (session 9, call 4)."""
import fsdpclip, sys as _s; print("fsdpclip from", fsdpclip.__file__, flush=True)
import time, sys, itertools, resource, cProfile, pstats, torch
from fsdpclip.data import ShardStream
from fsdpclip.model import build_tokenizer, image_transform, model_config, model_from_config
from fsdpclip.spec import ModelSpec, WebDatasetSpec
config = model_config(ModelSpec(name="ViT-B-32"))
model, tok = model_from_config(config, device="meta"), build_tokenizer(config)
spec = WebDatasetSpec(urls=sys.argv[2], samples=8000, workers=1, decode="mixed")
s = ShardStream(spec, image_transform(model, train=True), tok, 256, 0, 1, 0)
torch.set_num_threads(1)
it = s.worker_batches(0, 1); next(it)
for rep in range(3):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt; t = time.perf_counter()
    for b in itertools.islice(it, 3): del b
    dt = time.perf_counter() - t; f = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    print(sys.argv[1], "ms/sample", round(dt / 768 * 1e3, 3), "minor faults/sample", round(f / 768, 1), flush=True)
pr = cProfile.Profile(); pr.enable()
for b in itertools.islice(it, 3): del b
pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(8)

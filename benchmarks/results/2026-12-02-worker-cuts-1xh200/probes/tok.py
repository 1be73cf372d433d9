"""ViT-B-32's tokenizer called per caption (as the workers did) and per batch of 256 (as they do now), ms per
caption, and whether the results are equal. `python tok.py SHARD.tar`."""
import time, torch, sys
from fsdpclip.tarshards import shard_samples
from fsdpclip.model import model_config, build_tokenizer
from fsdpclip.spec import ModelSpec
torch.set_num_threads(1)
tok = build_tokenizer(model_config(ModelSpec(name="ViT-B-32")))
caps = [s["txt"].decode() for s in shard_samples(sys.argv[1], lambda e: True)][:1024]
for rep in range(3):
    t = time.perf_counter(); a = torch.stack([tok([c])[0] for c in caps]); t1 = time.perf_counter() - t
    t = time.perf_counter(); b = torch.cat([tok(caps[i:i + 256]) for i in range(0, len(caps), 256)]); t2 = time.perf_counter() - t
    print(f"per sample {t1 / len(caps) * 1e3:.4f} ms, per batch {t2 / len(caps) * 1e3:.4f} ms/caption, equal {torch.equal(a, b)}")

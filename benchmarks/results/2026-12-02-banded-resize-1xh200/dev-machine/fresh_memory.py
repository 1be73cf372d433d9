"""The padded batch's cost in fresh memory (decode.padded, private and shared as the workers make it), zeroing fresh
memory against zeroing it again with its pages mapped, MADV_POPULATE_WRITE before the fill, and tokenising captions
one by one against a batch at once; and a reused buffer (pages mapped), as decode.pooled_batch gives. 256 crops of 230–256 px. Run from a tree of fsdpclip: `python3 fresh_memory.py`."""
import ctypes, math, tarfile, time
import numpy as np
import torch
from fsdpclip.decode import padded, padded_shape
from fsdpclip.model import build_tokenizer, model_config
from fsdpclip.spec import ModelSpec

torch.set_num_threads(1)
libc = ctypes.CDLL(None, use_errno=True)
rng = np.random.default_rng(0)
crops = [rng.integers(0, 256, (int(rng.integers(230, 257)), int(rng.integers(230, 257)), 3), dtype=np.uint8) for _ in range(256)]
shape = (256, 256, 256, 3)
n = math.prod(shape)
for shared in (False, True):  # shared: fresh shared memory per batch, as the workers made it before pooled_batch
    times = []
    for _ in range(6):
        t = time.perf_counter()
        out = torch.empty(0, dtype=torch.uint8).new(torch.empty(0, dtype=torch.uint8)._typed_storage()._new_shared(
            math.prod(padded_shape(crops)))).view(padded_shape(crops)) if shared else None
        b = padded(crops, out=out); times.append((time.perf_counter() - t) * 1e3 / 256); del b, out
    print("padded, shared" if shared else "padded, private", [round(x, 3) for x in times], "ms/sample")
for _ in range(3):
    t = time.perf_counter(); x = torch.empty(shape, dtype=torch.uint8); x.zero_(); t1 = time.perf_counter(); x.zero_(); t2 = time.perf_counter()
    print(f"zero_ fresh {(t1 - t) * 1e3 / 256:.3f} ms/sample, again (pages mapped) {(t2 - t1) * 1e3 / 256:.3f}")
def fresh():
    return torch.empty(0, dtype=torch.uint8).new(torch.empty(0, dtype=torch.uint8)._typed_storage()._new_shared(n)).view(shape)
def populate(t):
    start = t.data_ptr() // 4096 * 4096
    return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t((t.data_ptr() + n - start + 4095) // 4096 * 4096), 23)
def fill(b):
    for slot, c in zip(b.numpy(), crops): slot[:c.shape[0], :c.shape[1]] = c
for name in ("zero + fill", "populate + zero + fill", "fill only (fresh is zero)", "populate + fill"):
    times = []
    for _ in range(5):
        t = time.perf_counter(); b = fresh()
        if "populate" in name: rc = populate(b)
        if "zero" in name: b.zero_()
        fill(b); times.append((time.perf_counter() - t) * 1e3 / 256); del b
    print(f"shared, {name:26s}", [round(x, 3) for x in times], "ms/sample", f"madvise -> {rc}" if "populate" in name else "")
reused = fresh()
reused.zero_()
for _ in range(1):
    times = []
    for _ in range(5):
        t = time.perf_counter(); reused.zero_(); fill(reused); times.append((time.perf_counter() - t) * 1e3 / 256)
    print(f"shared, {'reused buffer: zero + fill':26s}", [round(x, 3) for x in times], "ms/sample")
tok = build_tokenizer(model_config(ModelSpec(name="ViT-B-32")))
caps = []
with tarfile.open("/tmp/jpegdev/shards/000000.tar") as t:
    for m in t:
        if m.name.endswith(".txt"): caps.append(t.extractfile(m).read().decode())
        if len(caps) == 512: break
for _ in range(3):
    t0 = time.perf_counter(); a = torch.stack([tok([c])[0] for c in caps]); t1 = time.perf_counter(); b = tok(caps); t2 = time.perf_counter()
    print(f"tokenise one by one {(t1 - t0) / len(caps) * 1e3:.3f} ms/caption, a batch at once {(t2 - t1) / len(caps) * 1e3:.3f}, equal: {torch.equal(a, b)}")

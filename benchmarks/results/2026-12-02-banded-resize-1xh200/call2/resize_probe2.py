"""Probe (session 11, call 2, issue #15): the pinning thread's call for 'mixed' (CroppedBatch.pin_memory: pin,
copy, resize to uint8) in three trees' decode modules: edec907 (dense weights at every pixel), d29d0b9 (the
weights at each sample's taps only) and this tree's (also float16 tensor-core products with float32 results,
rows laid out for one bmm, uint8 out in one pass). A batch of 256 crops as OpenCLIP's RandomResizedCrop
draws them from 256×256 images, padded (256, 256, 256, 3) uint8 in shared memory, as a worker hands it over.
The older trees' modules are loaded from edec907_decode.py and d29d0b9_decode.py beside this file (make them
with `git show REV:fsdpclip/decode.py`). Pixels compared with edec907's; ms per call on an idle GPU and beside
another thread's matmuls; device time of the kernels (copies apart) per call. One run. Run from a tree of fsdpclip: `python3 resize_probe2.py`."""
import importlib.util, json, sys, threading, time
from pathlib import Path
import torch
from torch.profiler import ProfilerActivity, profile
from torchvision.transforms import RandomResizedCrop
import fsdpclip.decode as this_tree

here = Path(__file__).resolve().parent
def module(name):
    spec = importlib.util.spec_from_file_location(name, here / f"{name}.py")
    m = sys.modules[name] = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m
trees = {"edec907": module("edec907_decode"), "d29d0b9": module("d29d0b9_decode"), "this": this_tree}

dev = torch.device("cuda")
print("torch", torch.__version__, torch.cuda.get_device_name(), "half products:", this_tree._half_products(dev), flush=True)
torch.manual_seed(0)
n, side, size = 256, 256, (224, 224)
crop = RandomResizedCrop(224, scale=(0.9, 1.0))
boxes = torch.tensor([list(crop.get_params(torch.empty(3, side, side), crop.scale, crop.ratio)) for _ in range(n)])
boxes[:, :2] = 0  # the workers' crops, padded at their end
height, width = int(boxes[:, 2].max()), int(boxes[:, 3].max())
c = torch.randint(0, 256, (n, 3, height // 8, width // 8)).float()
pixels = torch.nn.functional.interpolate(c, size=(height, width), mode="bicubic").round().clamp(0, 255)
shared = pixels.to(torch.uint8).permute(0, 2, 3, 1).contiguous().share_memory_()  # (n, H, W, 3)

def call(m):
    out = m.CroppedBatch(shared, boxes, size).pin_memory()
    out.ready.synchronize()
    return out.pixels

want = call(trees["edec907"])
for name, m in trees.items():
    got = call(m)
    d = (got.int() - want.int()).abs()
    print(json.dumps({"tree": name, "dtype": str(got.dtype), "contiguous": got.is_contiguous(),
                      "pixels_differing_from_edec907": int((d > 0).sum()), "of": d.numel(), "max_levels": int(d.max())}), flush=True)

def timed(f, iters=30):
    f(); t = time.perf_counter()
    for _ in range(iters): f()
    return (time.perf_counter() - t) / iters * 1e3

def busy(stop):
    m = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    with torch.cuda.stream(torch.cuda.Stream(dev)):
        while not stop.is_set():
            for _ in range(10): m @ m
            torch.cuda.current_stream().synchronize()

for state in ("idle", "busy", "idle"):
    stop = threading.Event(); thread = None
    if state == "busy":
        thread = threading.Thread(target=busy, args=(stop,), daemon=True); thread.start(); time.sleep(1)
    print(json.dumps({"gpu": state, **{f"{k}_ms": round(timed(lambda: call(m)), 3) for k, m in trees.items()}}), flush=True)
    stop.set()
    if thread: thread.join()

for name, m in trees.items():
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10): call(m)
    rows = [(e.key, e.device_time_total / 10 / 1e3, e.count // 10) for e in prof.key_averages() if e.device_time_total > 0]
    kernels = [r for r in rows if not r[0].startswith("Memcpy") and not r[0].startswith("Memset")]
    kernels.sort(key=lambda r: -r[1])
    print(json.dumps({"tree": name, "kernel_ms_per_call": round(sum(r[1] for r in kernels), 3),
                      "kernels_per_call": sum(r[2] for r in kernels),
                      "copy_ms_per_call": round(sum(r[1] for r in rows if r[0].startswith("Memcpy")), 3),
                      "top": [(k[:60], round(ms, 3), cnt) for k, ms, cnt in kernels[:8]]}), flush=True)

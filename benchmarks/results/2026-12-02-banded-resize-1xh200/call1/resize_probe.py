"""Probe (session 11, issue #15): 'mixed''s device resize as the product had it (old_resize.py: dense weights
made at every pixel, the crops made channels-first, then float) against this tree's (fsdpclip.decode: the
weights made at each sample's taps only and spread into the dense matrix; channels last → float in one pass).
A batch of 256 crops as OpenCLIP's RandomResizedCrop draws them from 256×256 images, padded (256, 256, 256, 3)
uint8 on the GPU. Pixels compared; ms per batch on an idle GPU and beside another thread's matmuls; the
device time per kernel (torch.profiler). One run. Run from a tree of fsdpclip: `python3 resize_probe.py`."""
import json, sys, threading, time
from pathlib import Path
import torch
from torch.profiler import ProfilerActivity, profile
sys.path.insert(0, str(Path(__file__).resolve().parent))
import old_resize
from fsdpclip.decode import resample_weights, resized_crops
from torchvision.transforms import RandomResizedCrop

dev = torch.device("cuda")
print("torch", torch.__version__, torch.cuda.get_device_name(), flush=True)
torch.manual_seed(0)
n, side, size = 256, 256, (224, 224)
crop = RandomResizedCrop(224, scale=(0.9, 1.0))
boxes = torch.tensor([list(crop.get_params(torch.empty(3, side, side), crop.scale, crop.ratio)) for _ in range(n)])
boxes[:, :2] = 0  # the workers' crops, padded at their end
height, width = int(boxes[:, 2].max()), int(boxes[:, 3].max())
c = torch.randint(0, 256, (n, 3, height // 8, width // 8)).float()
pixels = torch.nn.functional.interpolate(c, size=(height, width), mode="bicubic").round().clamp(0, 255)
last = pixels.to(torch.uint8).permute(0, 2, 3, 1).contiguous().to(dev)  # (n, H, W, 3), as copied

sides = {"old": lambda: old_resize.resized_crops(last.permute(0, 3, 1, 2).contiguous(), boxes.to(dev, non_blocking=True), size),
         "new": lambda: resized_crops(last.permute(0, 3, 1, 2), boxes, size),
         "old_weights": lambda: (old_resize.resample_weights(boxes.to(dev)[:, 1], boxes.to(dev)[:, 3], width, 224),
                                 old_resize.resample_weights(boxes.to(dev)[:, 0], boxes.to(dev)[:, 2], height, 224)),
         "new_weights": lambda: (resample_weights(boxes[:, 1], boxes[:, 3], width, 224, dev),
                                 resample_weights(boxes[:, 0], boxes[:, 2], height, 224, dev))}
a, b = sides["old"](), sides["new"]()
d = (a - b).abs()
wa, wb = sides["old_weights"](), sides["new_weights"]()
print(json.dumps({"pixels_differing": int((d > 0).sum()), "of": d.numel(), "max_levels": d.max().item(),
                  "weights_max_abs_diff": max((x - y).abs().max().item() for x, y in zip(wa, wb))}), flush=True)

def timed(f, iters=30):
    s = torch.cuda.Stream(dev)
    with torch.cuda.stream(s):
        f(); s.synchronize(); t = time.perf_counter()
        for _ in range(iters): f()
        s.synchronize()
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
    print(json.dumps({"gpu": state, **{f"{k}_ms": round(timed(f), 3) for k, f in sides.items()}}), flush=True)
    stop.set()
    if thread: thread.join()

for name in ("old", "new"):
    f = sides[name]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10): f()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / 10 / 1e3, e.count // 10) for e in prof.key_averages()
            if e.device_time_total > 0]
    rows.sort(key=lambda r: -r[1])
    print(json.dumps({"side": name, "device_ms_per_batch": round(sum(r[1] for r in rows), 3),
                      "kernels_per_batch": sum(r[2] for r in rows),
                      "top": [(k[:70], round(ms, 3), cnt) for k, ms, cnt in rows[:12]]}), flush=True)

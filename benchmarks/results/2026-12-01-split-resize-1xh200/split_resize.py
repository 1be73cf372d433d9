"""Probe (session 10, issue #15): the crops' resize (decode.resized_crops: two fp32 batched matmuls with dense
PIL-bicubic weight matrices) against the same products as two float16 tensor-core products each (the weights
split into a float16 part and its float16 remainder; pixels, integers 0..255, exact in float16), accumulated
and returned in float32 (`torch.bmm(..., out_dtype=torch.float32)`). Pixels compared with the fp32 result;
ms per batch of 256 on an idle GPU and beside another thread's matmuls on its own stream. One run.
Run from a tree of fsdpclip: `python3 split_resize.py`."""
import json, threading, time
import torch
from fsdpclip.decode import resample_weights, resized_crops

dev = torch.device("cuda")
print("torch", torch.__version__, torch.cuda.get_device_name(), flush=True)

def split_bmm(pixels, weights, weights_left):
    high = weights.half(); low = (weights - high.float()).half(); p = pixels.half()
    mm = (lambda w: torch.bmm(w, p, out_dtype=torch.float32)) if weights_left else \
         (lambda w: torch.bmm(p, w, out_dtype=torch.float32))
    return mm(high) + mm(low)

def resized_split(batch, boxes, size):
    n, H, W = batch.shape[0], batch.shape[2], batch.shape[3]
    across = resample_weights(boxes[:, 1], boxes[:, 3], W, size[1])
    down = resample_weights(boxes[:, 0], boxes[:, 2], H, size[0])
    rows = split_bmm(batch.reshape(n, 3 * H, W), across.transpose(1, 2).contiguous(), False)
    rows = rows.round_().clamp_(0, 255).view(n * 3, H, size[1])
    out = split_bmm(rows, down.repeat_interleave(3, 0), True)
    return out.round_().clamp_(0, 255).view(n, 3, *size)

g = torch.Generator(device="cpu").manual_seed(0)
n, H, W = 256, 256, 256
sides = torch.randint(243, 257, (n, 2), generator=g)
boxes = torch.tensor([[int(torch.randint(0, H - h + 1, (1,), generator=g)), int(torch.randint(0, W - w + 1, (1,), generator=g)),
                       h, w] for h, w in sides.tolist()]).to(dev)
for kind in ("noise", "smooth"):
    if kind == "noise":
        batch = torch.randint(0, 256, (n, 3, H, W), dtype=torch.uint8, generator=g).to(dev)
    else:
        c = torch.randint(0, 256, (n, 3, H // 8, W // 8), generator=g).float()
        batch = torch.nn.functional.interpolate(c, size=(H, W), mode="bicubic").round().clamp(0, 255).to(torch.uint8).to(dev)
    try:
        a, b = resized_crops(batch, boxes, (224, 224)), resized_split(batch, boxes, (224, 224))
        d = (a - b).abs()
        print(json.dumps({"images": kind, "max_levels": d.max().item(), "fraction_differing": (d > 0).float().mean().item()}), flush=True)
    except Exception as e:
        print(json.dumps({"images": kind, "error": f"{type(e).__name__}: {str(e)[:300]}"}), flush=True)

def timed(f, iters=20):
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

for state in ("idle", "busy"):
    stop = threading.Event(); thread = None
    if state == "busy":
        thread = threading.Thread(target=busy, args=(stop,), daemon=True); thread.start(); time.sleep(1)
    row = {"gpu": state}
    for name, f in (("fp32", lambda: resized_crops(batch, boxes, (224, 224))),
                    ("split_fp16", lambda: resized_split(batch, boxes, (224, 224)))):
        try:
            row[name + "_ms"] = round(timed(f), 3)
        except Exception as e:
            row[name + "_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    stop.set()
    if thread: thread.join()
    print(json.dumps(row), flush=True)

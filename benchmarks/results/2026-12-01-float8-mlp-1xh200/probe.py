"""Probe (session 10, issue #14): torchao float8 training linears on this GPU and torch: the MLP of ViT-L/H/bigG
blocks (Linear, GELU, Linear), compiled, forward + backward under bf16 autocast, ms per iteration.
Run as: bash setup.sh (with torchao-0.18.0's wheel in .whl/) && python3 probe.py"""
import time, json, torch, torch.nn as nn
import torchao
from torchao.float8 import convert_to_float8_training, Float8LinearConfig
print("torch", torch.__version__, "torchao", torchao.__version__, torch.cuda.get_device_name(), flush=True)
def mlp(d, h):
    return nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, d)).cuda()
def bench(m, x, iters=30):
    f = torch.compile(m)
    for _ in range(3):
        with torch.autocast("cuda", torch.bfloat16):
            f(x).float().pow(2).mean().backward()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(iters):
        with torch.autocast("cuda", torch.bfloat16):
            f(x).float().pow(2).mean().backward()
    torch.cuda.synchronize(); return (time.perf_counter() - t) / iters * 1e3
for name, d, h, tokens in [("L-14@128", 1024, 4096, 128*257), ("H-14@64", 1280, 5120, 64*257), ("bigG-14@32", 1664, 8192, 32*257), ("bigG-14@64", 1664, 8192, 64*257)]:
    x = torch.randn(tokens, d, device="cuda", requires_grad=True)
    torch.manual_seed(0); base = mlp(d, h)
    row = {"case": name, "bf16_ms": round(bench(base, x), 3)}
    flops = 3 * 2 * 2 * tokens * d * h
    row["bf16_tflops"] = round(flops / row["bf16_ms"] / 1e9, 1)
    for recipe in ("rowwise", "tensorwise"):
        torch.manual_seed(0); m = mlp(d, h)
        try:
            convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name(recipe))
            row[recipe + "_ms"] = round(bench(m, x), 3)
            row[recipe + "_speedup"] = round(row["bf16_ms"] / row[recipe + "_ms"], 3)
        except Exception as e:
            row[recipe + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    print(json.dumps(row), flush=True)
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
for _ in range(3): a @ a
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(20): a @ a
torch.cuda.synchronize(); print("bf16 matmul TFLOPS", round(20 * 2 * 8192**3 / (time.perf_counter() - t) / 1e12, 1))

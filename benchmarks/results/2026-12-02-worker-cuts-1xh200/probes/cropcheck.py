"""crop_box against torchvision's get_params (default generator seeded alike) for 60,000 seeds, three crops and image
shapes where an early, a late or no attempt fits; then ms per call of each on a 256-px image. `python cropcheck.py`."""
import random, time, torch
from torchvision.transforms import RandomResizedCrop, InterpolationMode
from fsdpclip.decode import crop_box
rng = random.Random(0)
crops = [RandomResizedCrop(224, scale=(0.9, 1.0), interpolation=InterpolationMode.BICUBIC),
         RandomResizedCrop(224, scale=(0.08, 1.0), interpolation=InterpolationMode.BICUBIC),
         RandomResizedCrop(224, scale=(0.5, 1.0), ratio=(0.5, 2.0), interpolation=InterpolationMode.BICUBIC)]
n = mism = 0
for crop in crops:
    for _ in range(20000):
        h, w = rng.choice([(256, 256), (256, 340), (480, 640), (1000, 60), (64, 900), (3, 5), (1, 1)])
        img = torch.empty(3, h, w)
        seed = rng.randrange(-2**63, 2**63)
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            want = crop.get_params(img, crop.scale, crop.ratio)
        got = crop_box(crop, h, w, seed)
        n += 1; mism += want != got
print(n, "mismatches", mism)
img = torch.empty(3, 256, 256); crop = crops[0]
for f, name in [(lambda s: crop.get_params(img, crop.scale, crop.ratio), "get_params"), (lambda s: crop_box(crop, 256, 256, s), "crop_box")]:
    t = time.perf_counter()
    for s in range(5000): f(s)
    print(name, (time.perf_counter() - t) / 5000 * 1e3, "ms")

"""The crop draws (fork_rng + get_params as before, crop_box now) timed in the main process and in a DataLoader
worker process, ms per 256-px PIL image. `python forked.py`."""
import time, torch
from torch.utils.data import DataLoader, IterableDataset
from torchvision.transforms import RandomResizedCrop, InterpolationMode
from PIL import Image
from fsdpclip.decode import crop_box
crop = RandomResizedCrop(224, scale=(0.9, 1.0), interpolation=InterpolationMode.BICUBIC)
img = Image.new("RGB", (256, 256))
def timing():
    out = {}
    t = time.perf_counter()
    for s in range(5000):
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(s)
            crop.get_params(img, crop.scale, crop.ratio)
    out["fork_rng+get_params"] = (time.perf_counter() - t) / 5000 * 1e3
    t = time.perf_counter()
    for s in range(5000):
        crop_box(crop, 256, 256, s)
    out["crop_box"] = (time.perf_counter() - t) / 5000 * 1e3
    return out
class D(IterableDataset):
    def __iter__(self):
        yield timing()
if __name__ == "__main__":
    torch.set_num_threads(1)
    print("main", timing())
    print("worker", next(iter(DataLoader(D(), batch_size=None, num_workers=1))))
    if torch.cuda.is_available():
        torch.zeros(1, device="cuda")
        print("worker after cuda init", next(iter(DataLoader(D(), batch_size=None, num_workers=1))))

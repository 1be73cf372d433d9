"""open_clip_train's own webdataset pipeline (open_clip_train.data.get_wds_dataset, ViT-B-32's train transform and
tokenizer, batch 256) alone, without a model: samples/s the rank takes from W DataLoader workers after the first
SKIP batches, as benchmarks/data_rate.py's "workers" stage measures fsdpclip's. Needs webdataset<=0.2.86 and pandas
first on the path: `PYTHONPATH=SITE python openclip_supply.py SHARDS SAMPLES WORKERS BATCHES SKIP`."""
import argparse, itertools, json, sys, time
import torch
import open_clip
from open_clip_train.data import get_wds_dataset

urls, samples, workers, batches, skip = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
model_cfg = open_clip.get_model_config("ViT-B-32")
preprocess = open_clip.image_transform(model_cfg["vision_cfg"]["image_size"], is_train=True)
tokenizer = open_clip.get_tokenizer("ViT-B-32")
args = argparse.Namespace(train_data=urls, train_num_samples=samples, dataset_resampled=False,
                          train_data_upsampling_factors=None, seed=0, batch_size=256, world_size=1, workers=workers)
info = get_wds_dataset(args, preprocess, is_train=True, epoch=0, tokenizer=tokenizer)
began = time.perf_counter()
for index, (images, texts) in enumerate(itertools.islice(info.dataloader, batches)):
    if index + 1 == skip:
        started = time.perf_counter()
ended = time.perf_counter()
print(json.dumps({"trainer": "open_clip_train", "workers": workers, "stage": "workers", "batch": 256,
                  "image": list(images.shape[1:]), "dtype": str(images.dtype),
                  "first_batches_s": round(started - began, 2),
                  "samples_per_s": round((batches - skip) * 256 / (ended - started), 1)}))

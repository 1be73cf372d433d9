"""Parallelizes a model on the meta device with wrap and checkpointing classes that the direct forwards
replace (Conv2d, MultiheadAttention), compiled with inductor options, on a fake process group of 2 (no peers,
collectives are no-ops).

    plan_classes.py MODEL_CONFIG   → JSON {"sharded": [...], "checkpointed": [...], "direct": [...],
                                           "compiled": [the inductor options of each torch.compile call]}
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.testing._internal.distributed.fake_pg import FakeStore

from fsdpclip.model.build import build_model, find_towers
from fsdpclip.model.fast_modules import DirectAttention, DirectPatchEmbedding
from fsdpclip.parallel.parallelize import parallelize
from fsdpclip.plan.resolved import unit_layout
from fsdpclip.jobspec.job import FsdpSpec, ModelSpec


def main(config: str) -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    model = build_model(ModelSpec(config=config), "meta")
    fsdp = FsdpSpec(param_dtype="fp32", wrap={"image": ["ResidualAttentionBlock", "Conv2d"]},
                    activation_checkpointing={"text": ["MultiheadAttention"]},
                    compile=True, compile_options={"coordinate_descent_tuning": True})
    compiled, original = [], torch.compile

    def recording_compile(fn, **kwargs):  # torch's own, which checks the options against its inductor
        compiled.append(kwargs.get("options"))
        return original(fn, **kwargs)

    torch.compile = recording_compile
    layout = unit_layout(fsdp, model, find_towers(model), "cpu")
    parallelize(model, fsdp, layout, init_device_mesh("cpu", (2,)))
    modules = dict(model.named_modules())
    print(json.dumps({
        "sharded": [name for name, m in modules.items() if isinstance(m, FSDPModule)],
        "checkpointed": [name for name, m in modules.items() if checkpoint.state(m) is not None],
        "direct": [name for name, m in modules.items() if isinstance(m, (DirectAttention, DirectPatchEmbedding))],
        "compiled": compiled}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

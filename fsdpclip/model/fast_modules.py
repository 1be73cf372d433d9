"""OpenCLIP's modules with direct forwards: the same function, parameters and names, faster kernels.

`DirectAttention`: OpenCLIP 3.3's `ResidualAttentionBlock` calls `nn.MultiheadAttention`, which in
training goes through `F.multi_head_attention_forward`: a transpose to sequence-first and back,
contiguous copies of q/k/v, and a page of argument checks per call. `DirectAttention` computes the same
function (same packed in-projection, `F.scaled_dot_product_attention`, out-projection) straight from
batch-first inputs. Calls it does not cover (attention weights asked for, padding masks, boolean or
per-head masks, separate k/v projections, bias_kv, zero_attn) go to the original. In an OpenCLIP text
tower whose mask is its causal mask (-inf above the diagonal, `build_causal_mask`), the attention is
told so (`is_causal`) instead of adding the mask: the same function; the kernels read no mask and may
skip the tiles above the diagonal.

`DirectPatchEmbedding`: a ViT's patch embedding is a `Conv2d` whose stride is its kernel (OpenCLIP's
`conv1`). Over non-overlapping patches that convolution is one matmul of the
image's patches, laid out as rows, with the flattened kernel; cuDNN's convolution kernels for these
shapes (3 input channels, 14- or 32-pixel kernels) run far below the matmul rate, its weight gradient
most of all (docs/performance.md).

Both are their module's class with another `forward`, swapped in place, so state-dict names, freeze
ranges and decay rules are unchanged.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class DirectAttention(nn.MultiheadAttention):
    """`nn.MultiheadAttention` whose common batch-first case calls SDPA directly. `mask_is_causal`: the 2-D
    mask it is given for self-attention is the causal mask (set by `use_direct_attention`)."""

    mask_is_causal = False

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: Optional[torch.Tensor] = None, need_weights: bool = True,
                attn_mask: Optional[torch.Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False):
        if not self._covers(query, key, value, key_padding_mask, need_weights, attn_mask):
            return super().forward(query, key, value, key_padding_mask=key_padding_mask, need_weights=need_weights,
                                   attn_mask=attn_mask, average_attn_weights=average_attn_weights,
                                   is_causal=is_causal)
        batch, length, width = query.shape
        heads = self.num_heads
        if key is query and value is query:
            q, k, v = F.linear(query, self.in_proj_weight, self.in_proj_bias) \
                .view(batch, length, 3, heads, width // heads).permute(2, 0, 3, 1, 4).unbind(0)
        else:
            weights, biases = self.in_proj_weight.chunk(3), (self.in_proj_bias.chunk(3)
                                                             if self.in_proj_bias is not None else (None,) * 3)
            q, k, v = (F.linear(x, w, b).view(batch, x.shape[1], heads, width // heads).transpose(1, 2)
                       for x, w, b in zip((query, key, value), weights, biases))
        if self.mask_is_causal and key is query and attn_mask is not None and attn_mask.shape == (length, length):
            attn_mask, is_causal = None, True
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal and attn_mask is None,
                                             dropout_p=self.dropout if self.training else 0.0)
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, width)), None

    def _covers(self, query, key, value, key_padding_mask, need_weights, attn_mask) -> bool:
        return (self.batch_first and self._qkv_same_embed_dim and self.bias_k is None and not self.add_zero_attn
                and not need_weights and key_padding_mask is None and query.dim() == 3
                and key.shape == value.shape
                and (attn_mask is None or (attn_mask.dim() == 2 and attn_mask.is_floating_point())))


def use_direct_attention(model: nn.Module) -> int:
    """Give every plain `nn.MultiheadAttention` of `model` DirectAttention's forward (in place, any
    device, meta included); returns how many. Those of an OpenCLIP text tower with a causal mask
    (`causal_text_transformers`) learn that their 2-D mask is it."""
    count = _swap([m for m in model.modules() if type(m) is nn.MultiheadAttention], DirectAttention)
    for transformer in causal_text_transformers(model):
        for module in transformer.modules():
            if isinstance(module, DirectAttention):
                module.mask_is_causal = True
    return count


def causal_text_transformers(model: nn.Module) -> list[nn.Module]:
    """The block containers OpenCLIP calls with its causal mask: `transformer` of a CLIP model or a
    TextTransformer holding an `attn_mask` buffer (OpenCLIP builds it with `build_causal_mask`; a tower
    without one, `no_causal_mask`, holds None). Where padding or a class token joins it, the mask given is
    3-D (batch × heads), which DirectAttention leaves to the original."""
    return [module.transformer for module in model.modules() if _is_open_clip(module, "CLIP", "TextTransformer")
            and module._buffers.get("attn_mask") is not None and isinstance(module.transformer, nn.Module)]


def _is_open_clip(module: nn.Module, *names: str) -> bool:
    return type(module).__module__.startswith("open_clip") and type(module).__name__ in names


def _swap(modules: list[nn.Module], direct: type) -> int:
    """Give each module the `direct` subclass of its class (its forward; state unchanged); returns how many."""
    for module in modules:
        module.__class__ = direct
    return len(modules)


class DirectPatchEmbedding(nn.Conv2d):
    """A `Conv2d` over non-overlapping patches (stride = kernel, no padding) computed as one matmul.

    The output is the convolution's (N, C, H', W') as a view of (N, H', W', C) memory, so the usual
    flattening into (N, H'W', C) tokens (OpenCLIP's reshape and permute, timm's flatten and transpose)
    costs no copy. Rows and columns the kernel does not reach are dropped, as the convolution drops them;
    unbatched images and images smaller than the kernel go to the convolution (which refuses the latter)."""

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        (ph, pw), out_channels = self.kernel_size, self.out_channels
        if images.dim() != 4 or images.shape[2] < ph or images.shape[3] < pw:
            return super().forward(images)
        batch, channels, height, width = images.shape
        rows, cols = height // ph, width // pw
        patches = images[:, :, :rows * ph, :cols * pw].reshape(batch, channels, rows, ph, cols, pw) \
            .permute(0, 2, 4, 1, 3, 5).reshape(batch * rows * cols, channels * ph * pw)
        tokens = F.linear(patches, self.weight.reshape(out_channels, -1), self.bias)
        return tokens.view(batch, rows, cols, out_channels).permute(0, 3, 1, 2)


def is_patch_embedding(module: object) -> bool:
    """A plain `nn.Conv2d` over non-overlapping patches of more than one pixel, without padding."""
    return (type(module) is nn.Conv2d and module.groups == 1 and module.stride == module.kernel_size
            and max(module.kernel_size) > 1 and module.padding in ((0, 0), "valid") and module.dilation == (1, 1))


def use_direct_patch_embedding(model: nn.Module) -> int:
    """Give the patch embedding (`conv1`, `is_patch_embedding`) of every OpenCLIP VisionTransformer in
    `model` DirectPatchEmbedding's forward (in place, any device, meta included); returns how many. Other
    libraries' patch embeddings (timm's) stay convolutions until measured (docs/performance.md)."""
    return _swap([m.get_submodule("conv1") for m in model.modules() if _is_open_clip(m, "VisionTransformer")
                  and is_patch_embedding(getattr(m, "conv1", None))], DirectPatchEmbedding)

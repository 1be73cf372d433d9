"""OpenCLIP's attention without `nn.MultiheadAttention`'s Python path.

OpenCLIP 3.3's `ResidualAttentionBlock` calls `nn.MultiheadAttention`, which in training goes
through `F.multi_head_attention_forward`: a transpose to sequence-first and back, contiguous
copies of q/k/v, and a page of argument checks per call. `DirectAttention` computes the same
function (same packed in-projection, `F.scaled_dot_product_attention`, out-projection) straight
from batch-first inputs. It is `nn.MultiheadAttention` with another `forward`, so parameters,
state-dict names, freeze ranges and decay rules are unchanged; calls it does not cover (attention
weights asked for, padding masks, boolean or per-head masks, separate k/v projections, bias_kv,
zero_attn) go to the original.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class DirectAttention(nn.MultiheadAttention):
    """`nn.MultiheadAttention` whose common batch-first case calls SDPA directly."""

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
    device, meta included); returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is nn.MultiheadAttention:
            module.__class__ = DirectAttention
            count += 1
    return count

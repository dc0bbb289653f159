# SPDX-License-Identifier: Apache-2.0
"""The model of the experiments: a small decoder built around one kind of token mixer.

    embedding -> num_layers x [x + mixer(RMSNorm(x)); x + SwiGLU(RMSNorm(x))] -> RMSNorm -> head

(the blocks of hila.torch.HilaLM, with any mixer of :mod:`hila.experiments.mixers`). The recall
tasks score a few positions per sequence (the same number k in every sequence), so the vocabulary
head runs only there: ``loss`` takes those positions [B, k] and projects just those rows
([B k, D] x [D, V] instead of [B T, D] x [D, V]), the same cross entropy as a full head with the
other labels ignored, and without the host synchronisation of a boolean mask.
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..torch.models import GatedMLP
from .mixers import MixerShape, build_mixer

__all__ = ["RecallLM"]


class _Block(nn.Module):
    def __init__(self, mixer: nn.Module, dim: int, mlp_ratio: float, eps: float):
        super().__init__()
        self.mixer_norm, self.mixer = nn.RMSNorm(dim, eps=eps), mixer
        self.mlp_norm, self.mlp = nn.RMSNorm(dim, eps=eps), GatedMLP(dim, mlp_ratio)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.mixer(self.mixer_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class RecallLM(nn.Module):
    """Decoder of ``num_layers`` blocks with mixer ``mixer`` at width ``dim``.

    Linear and embedding weights are drawn from N(0, init_std^2) (biases zero); the mixers' own
    parameters (gates, convolutions, norms, level weights) keep their layers' initialisation.

    ``tie_embeddings``: the head is the embedding (W_head = E [V, D], as in Zoology), so the logit
    of token v is h . E[v]. A recall model then only has to carry a value's own embedding to its
    query; with a separate head, each of the V/2 value tokens must also learn its own output row
    from the few batches it occurs in, which at V = 8192 delays learning by thousands of steps.
    """

    def __init__(self, vocab_size: int, dim: int, mixer: str, max_len: int, num_layers: int = 2,
                 mlp_ratio: float = 4.0, init_std: float = 0.02, shape: MixerShape = MixerShape(),
                 eps: float = 1e-5, tie_embeddings: bool = False):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList(_Block(build_mixer(mixer, dim, max_len, shape), dim, mlp_ratio, eps)
                                    for _ in range(num_layers))
        self.norm = nn.RMSNorm(dim, eps=eps)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=init_std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
        if tie_embeddings:
            self.head.weight = self.embed.weight

    def hidden(self, ids: Tensor) -> Tensor:
        """ids [B, T] -> final hidden states [B, T, D] (after the last norm)."""
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)

    def scored(self, ids: Tensor, pos: Tensor) -> Tensor:
        """Logits [B, k, V] at positions pos [B, k] of each sequence ids [B, T]."""
        h = self.hidden(ids)
        return self.head(h.gather(1, pos.unsqueeze(-1).expand(-1, -1, h.shape[-1])))

    def loss(self, ids: Tensor, pos: Tensor, target: Tensor) -> Tuple[Tensor, Tensor]:
        """Mean cross entropy of targets [B, k] at positions pos [B, k], and the correct argmax
        predictions (bool [B, k]). No host synchronisation."""
        logits = self.scored(ids, pos)
        return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten()), logits.argmax(-1) == target

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

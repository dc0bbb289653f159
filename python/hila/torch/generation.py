# SPDX-License-Identifier: Apache-2.0
"""The argument handling and the token sampler of :meth:`hila.torch.HilaLM.generate`, with the
names of Hugging Face's ``generate`` (``input_ids``, ``attention_mask``, ``max_length``,
``do_sample``, ``temperature``, ``top_k``, ``top_p``)."""
from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .._errors import HilaError

__all__ = ["prompt_rows", "new_token_count", "sample"]


def prompt_rows(prompts: Union[None, Tensor, Sequence[Tensor]], input_ids: Optional[Tensor],
                attention_mask: Optional[Tensor]) -> List[Tensor]:
    """The prompts as 1-D token tensors: ``prompts`` (a [B, T] tensor, one 1-D tensor or a list of
    them) or ``input_ids`` [B, T] with an optional ``attention_mask`` [B, T] (0: padding, on
    either side), as Hugging Face passes a padded batch."""
    if (prompts is None) == (input_ids is None):
        raise HilaError("hila: argument 'input_ids': expected the prompts either as `prompts` or as "
                        "`input_ids` (one of them), got " + ("both" if input_ids is not None else "neither"),
                        "input_ids")
    if input_ids is not None:
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
            raise HilaError("hila: argument 'input_ids': expected a [B, T] tensor of token ids, got "
                            f"{type(input_ids).__name__} {list(getattr(input_ids, 'shape', []))}", "input_ids")
        if attention_mask is None:
            return list(input_ids)
        if not isinstance(attention_mask, Tensor) or attention_mask.shape != input_ids.shape:
            raise HilaError(f"hila: argument 'attention_mask': expected a [B, T] = "
                            f"{list(input_ids.shape)} 0/1 tensor, got "
                            f"{list(getattr(attention_mask, 'shape', []))}", "attention_mask")
        return [row[m != 0] for row, m in zip(input_ids, attention_mask)]
    if attention_mask is not None:
        raise HilaError("hila: argument 'attention_mask': goes with input_ids (a padded batch); "
                        "`prompts` are unpadded", "attention_mask")
    rows = list(prompts) if not isinstance(prompts, Tensor) or prompts.dim() == 2 else [prompts]
    if not rows or any(not isinstance(r, Tensor) or r.dim() != 1 for r in rows):
        raise HilaError("hila: argument 'prompts': expected a [B, T] tensor or 1-D token tensors",
                        "prompts")
    return rows


def new_token_count(max_new_tokens: Optional[int], max_length: Optional[int], prompt_length: int) -> int:
    """Tokens to generate: ``max_new_tokens``, else ``max_length - prompt_length`` (Hugging Face's
    rule: ``max_length`` counts the prompt, its padded length for a padded batch)."""
    if max_new_tokens is None:
        if max_length is None:
            raise HilaError("hila: argument 'max_new_tokens': expected max_new_tokens or max_length, "
                            "got neither", "max_new_tokens")
        max_new_tokens = int(max_length) - prompt_length
        if max_new_tokens < 1:
            raise HilaError(f"hila: argument 'max_length': expected more than the prompt length "
                            f"({prompt_length}), got {max_length}", "max_length")
    if max_new_tokens < 1:
        raise HilaError(f"hila: argument 'max_new_tokens': expected >= 1, got {max_new_tokens}",
                        "max_new_tokens")
    return int(max_new_tokens)


def sample(logits: Tensor, *, do_sample: Optional[bool] = None, temperature: float = 0.0,
           top_k: Optional[int] = None, top_p: Optional[float] = None,
           generator: Optional[torch.Generator] = None) -> Tensor:
    """The next token of each row of ``logits [N, vocab]``: greedy (argmax) unless sampling.

    Sampling happens with ``do_sample=True``, or with ``do_sample=None`` and ``temperature > 0``;
    it draws from ``softmax(logits / temperature)`` (temperature 1 when sampling is asked for with
    temperature 0), restricted to the ``top_k`` most likely tokens and then to the smallest set
    whose probability reaches ``top_p`` (nucleus sampling), in Hugging Face's order."""
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise HilaError(f"hila: argument 'top_p': expected a probability in (0, 1], got {top_p}", "top_p")
    if top_k is not None and top_k < 1:
        raise HilaError(f"hila: argument 'top_k': expected >= 1, got {top_k}", "top_k")
    sampling = temperature > 0 if do_sample is None else bool(do_sample)
    if not sampling:
        return logits.argmax(-1)
    logits = logits.float() / (temperature if temperature > 0 else 1.0)
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        probs = F.softmax(sorted_logits, -1)
        # drop a token when the tokens before it already reach top_p (the first one always stays)
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(F.softmax(logits, -1), 1, generator=generator).squeeze(-1)

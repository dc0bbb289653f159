# SPDX-License-Identifier: Apache-2.0
"""Checkpoints of :class:`hila.torch.HilaLM` in Hugging Face's directory layout, without needing
transformers: ``config.json`` (``model_type`` "hila", the fields of :class:`hila.hf.HilaConfig`)
and ``model.safetensors`` (the weights under the names of :class:`hila.hf.HilaForCausalLM`, i.e.
``model.`` + HilaLM's names). ``HilaLM.save_pretrained`` writes what
``AutoModelForCausalLM.from_pretrained`` loads (after ``import hila.hf``), and
``HilaLM.from_pretrained`` reads what ``HilaForCausalLM.save_pretrained`` writes (one file or
shards with ``model.safetensors.index.json``)."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict

import torch

from .._errors import HilaError

__all__ = ["lm_config_to_dict", "lm_config_from_dict", "save_pretrained", "load_pretrained"]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
PREFIX = "model."
# HilaLMConfig field -> config.json key (Hugging Face's name where it has one)
_RENAMED = {"num_layers": "num_hidden_layers"}


def lm_config_to_dict(cfg) -> Dict[str, Any]:
    """A HilaLMConfig as the fields of config.json."""
    d = {_RENAMED.get(f.name, f.name): getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    d["mixer_kwargs"] = dict(d["mixer_kwargs"])
    return d


def lm_config_from_dict(d: Dict[str, Any]):
    """The HilaLMConfig of config.json fields (other keys are ignored)."""
    from .models import HilaLMConfig
    back = {v: k for k, v in _RENAMED.items()}
    names = {f.name for f in dataclasses.fields(HilaLMConfig)}
    return HilaLMConfig(**{back.get(k, k): v for k, v in d.items() if back.get(k, k) in names})


def _safetensors():
    try:
        import safetensors.torch
        return safetensors.torch
    except ImportError:
        raise HilaError("hila: argument 'path': checkpoints are safetensors files; install the "
                        "safetensors package (pip install safetensors)", "path") from None


def save_pretrained(model, path: str) -> None:
    """Writes ``model`` (a HilaLM) to directory ``path`` (created if needed)."""
    st = _safetensors()
    os.makedirs(path, exist_ok=True)
    weights = {PREFIX + k: v.detach().contiguous() for k, v in model.state_dict().items()}
    dtype = next(iter(weights.values())).dtype if weights else torch.float32
    config = {"model_type": "hila", "architectures": ["HilaForCausalLM"],
              **lm_config_to_dict(model.config), "tie_word_embeddings": False,
              "dtype": str(dtype).rsplit(".", 1)[-1]}
    with open(os.path.join(path, CONFIG_NAME), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    st.save_file(weights, os.path.join(path, WEIGHTS_NAME), metadata={"format": "pt"})


def load_pretrained(cls, path: str, device: Any = None):
    """A ``cls`` (HilaLM) from a directory written by :func:`save_pretrained` or by
    ``HilaForCausalLM.save_pretrained``; parameters in the checkpoint's dtype."""
    st = _safetensors()
    cfg_file = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(cfg_file):
        raise HilaError(f"hila: argument 'path': expected a checkpoint directory with {CONFIG_NAME}, "
                        f"got {path!r}", "path")
    with open(cfg_file) as f:
        raw = json.load(f)
    if raw.get("model_type") != "hila":
        raise HilaError(f"hila: argument 'path': {cfg_file} is not a hila checkpoint (model_type "
                        f"{raw.get('model_type')!r}, expected 'hila')", "path")
    index = os.path.join(path, INDEX_NAME)
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, WEIGHTS_NAME)):
        files = [WEIGHTS_NAME]
    else:
        raise HilaError(f"hila: argument 'path': no {WEIGHTS_NAME} (or {INDEX_NAME}) in {path!r}", "path")
    weights = {}
    for name in files:
        weights.update(st.load_file(os.path.join(path, name), device="cpu"))
    sd = {k[len(PREFIX):]: v for k, v in weights.items() if k.startswith(PREFIX)}
    model = cls(lm_config_from_dict(raw))
    if sd:
        model.to(next(iter(sd.values())).dtype)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise HilaError(f"hila: argument 'path': the checkpoint does not match its config: missing "
                        f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}", "path")
    return model.to(device) if device is not None else model

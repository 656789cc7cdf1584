"""Run on every rank: replace the Hub loading (AutoTokenizer / AutoModelForSequenceClassification
`from_pretrained`) with hub.py's, run the example file unchanged as `__main__`, then print on rank 0 one
`EXAMPLES_PARITY_WEIGHTS <sha256> <L2 change>` line for the model it built (trained in place)."""

from __future__ import annotations

import hashlib
import os
import runpy
import sys

import hub
import torch
import transformers

built: list[tuple[torch.nn.Module, dict[str, torch.Tensor]]] = []


def _model(*args, **kwargs):
    model = hub.bert_for_classification()
    built.append((model, {k: v.detach().clone() for k, v in model.state_dict().items()}))
    return model


transformers.AutoTokenizer.from_pretrained = staticmethod(lambda *a, **k: hub.tokenizer())
transformers.AutoModelForSequenceClassification.from_pretrained = staticmethod(_model)

example, *arguments = sys.argv[1:]
sys.argv = [example, *arguments]
try:
    runpy.run_path(example, run_name="__main__")
finally:
    if os.environ.get("RANK", "0") == "0" and built:
        model, initial = built[-1]
        digest = hashlib.sha256()
        change = 0.0
        for name, value in sorted(model.state_dict().items()):
            digest.update(value.detach().cpu().contiguous().numpy().tobytes())
            if value.is_floating_point():
                change += float((value.detach().cpu() - initial[name]).double().pow(2).sum())
        print(f"EXAMPLES_PARITY_WEIGHTS {digest.hexdigest()[:16]} {change ** 0.5:.6f}", flush=True)

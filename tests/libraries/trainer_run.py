"""transformers' `Trainer` on a tiny random BERT and a synthetic dataset (no Hub), optionally with a PEFT LoRA
adapter: `train(lora)` runs one training on the ranks it is started on and returns what the test compares.
Started by `notebook_launcher(train, ...)` in a kernel, and by torchrun as a script (`python trainer_run.py
[--lora] OUT.json`: rank 0 writes the result), the way `accelerate launch --multi_gpu` starts it."""

from __future__ import annotations

import json
import os
import sys
import tempfile


class PairDataset:
    """64 sentences of token ids; label 1 when token 7 appears (learnable)."""

    def __init__(self, size: int = 64) -> None:
        import torch

        generator = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(5, 40, (size, 12), generator=generator)
        self.labels = (self.ids == 7).any(dim=1).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        import torch

        return {"input_ids": self.ids[index], "attention_mask": torch.ones(12, dtype=torch.long),
                "labels": self.labels[index]}


def train(lora: bool = False) -> dict:
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments, set_seed

    set_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2,
                                                     num_attention_heads=2, intermediate_size=64,
                                                     max_position_embeddings=16, num_labels=2))
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"],
                                                 task_type="SEQ_CLS"))
    with tempfile.TemporaryDirectory(prefix="trainer-run-") as output_dir:  # nothing is saved: none left behind
        args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=4, num_train_epochs=2,
                                 learning_rate=5e-3, logging_steps=1, save_strategy="no", report_to=[],
                                 use_cpu=True, seed=0, data_seed=0, disable_tqdm=False)
        trainer = Trainer(model=model, args=args, train_dataset=PairDataset())
        result = trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"world_size": trainer.args.world_size, "process_index": trainer.args.process_index,
            "distributed_type": str(trainer.accelerator.distributed_type), "steps": trainer.state.global_step,
            "losses": losses, "train_loss": result.training_loss, "trainable": trainable,
            "accelerator_module": type(trainer.accelerator).__module__, "rank_env": os.environ.get("RANK"),
            "checksum": float(sum(p.detach().double().sum() for p in model.parameters()))}


if __name__ == "__main__":
    use_lora = "--lora" in sys.argv
    out = train(use_lora)
    if out["process_index"] == 0:
        with open(sys.argv[-1], "w") as handle:
            json.dump(out, handle)

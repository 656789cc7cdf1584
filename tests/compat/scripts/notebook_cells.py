# A notebook as an Accelerate user writes it: the training function is defined in a cell (so it lives in __main__),
# then launched with notebook_launcher. The test runs this source in a module named __main__.
import torch
from accelerate import Accelerator, notebook_launcher
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

hidden_size = 8  # a notebook global the function closes over


def training_loop(mixed_precision="no", seed: int = 42, batch_size: int = 4):
    set_seed(seed)
    accelerator = Accelerator(mixed_precision=mixed_precision)
    x = torch.randn(32, 3)
    dataloader = DataLoader(TensorDataset(x, x.sum(1)), batch_size=batch_size, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(3, hidden_size), torch.nn.ReLU(), torch.nn.Linear(hidden_size, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    for epoch in range(2):
        for inputs, targets in dataloader:
            with accelerator.autocast():
                loss = torch.nn.functional.mse_loss(model(inputs).squeeze(-1), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        accelerator.print(f"epoch {epoch} loss {loss.item():.4f}")
    return {"rank": accelerator.process_index, "world": accelerator.num_processes,
            "checksum": sum(p.sum().item() for p in accelerator.unwrap_model(model).parameters())}


args = ("no", 42, 4)
results = notebook_launcher(training_loop, args, num_processes=2)

"""A Lightning Trainer guarded by nanguard's callback: python examples/lightning_train.py
(needs `pip install 'nanguard[lightning]'`; add --devices 2 for DDP on the CPU)."""

import argparse

import lightning as L
import torch
from torch import nn

import nanguard
from nanguard.integrations.lightning import NanguardCallback


class Regressor(L.LightningModule):
    def __init__(self, bad_step: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        self.bad_step = bad_step

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_step == self.bad_step:
            x = x.clone()
            x[0, 0] = float("nan")
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--bad-step", type=int, default=-1)
    parser.add_argument("--devices", type=int, default=1)
    args = parser.parse_args()
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(512, 8), torch.randn(512, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    trainer = L.Trainer(max_steps=args.steps, accelerator="cpu", devices=args.devices,
                        callbacks=[NanguardCallback()], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    try:
        trainer.fit(Regressor(args.bad_step), loader)
        print(f"{args.steps} steps, no non-finite value")
    except nanguard.NonFiniteError as err:
        print(f"stopped before step {err.event.step}'s update: {err.event.where()}")


if __name__ == "__main__":
    main()  # the model is freed when main() returns; end the process group after it (README)
    nanguard.destroy_process_group()

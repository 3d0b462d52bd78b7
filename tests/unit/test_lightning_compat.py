"""The private Lightning API of ``mrtpo.lightning.compat`` exists in the installed version,
which is the one the module was written for."""

from __future__ import annotations

import lightning as L
import torch

from mrtpo.lightning import compat as lightning_compat


def test_written_for_the_installed_lightning():
    major_minor = ".".join(L.__version__.split(".")[:2])
    assert major_minor == lightning_compat.WRITTEN_FOR, (
        f"lightning {L.__version__} is installed; mrtpo.lightning.compat was written for "
        f"{lightning_compat.WRITTEN_FOR}: check each of its functions against this version "
        "(the private names it uses), then update WRITTEN_FOR"
    )


class _Counted(L.LightningModule):
    """Two optimizer updates per batch, only the second counted; every third batch skipped."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.w = torch.nn.Parameter(torch.ones(2))
        self.updates = 0

    def configure_optimizers(self):
        return torch.optim.SGD([self.w], lr=0.1)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        if batch_idx % 3 == 2:
            lightning_compat.count_step(opt)
            return None
        for counted in (False, True):
            opt.zero_grad()
            self.manual_backward((self.w * batch[0]).sum())
            if counted:
                opt.step()
            else:
                lightning_compat.step_without_counting(opt)
            self.updates += 1
        self.log("train/w", self.w.detach().sum())
        return None

    def train_dataloader(self):
        return torch.utils.data.DataLoader([torch.ones(2)] * 6, batch_size=1)


def test_global_step_counts_rl_steps_and_metrics_reach_the_logger(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    module = _Counted()
    trainer = L.Trainer(
        max_steps=5,
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    assert trainer.global_step == 5  # batches 0-4: four trained, one skipped
    assert module.updates == 8  # two updates each for batches 0, 1, 3, 4
    text = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    header, *rows = text.strip().splitlines()
    assert "train/w" in header.split(",")
    # one row per RL step, numbered by global_step: the skipped batch 2 counted as step 2
    step = header.split(",").index("step")
    assert [r.split(",")[step] for r in rows] == ["0", "1", "2", "3", "4"]

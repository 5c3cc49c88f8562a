"""A window loader as a PyTorch iterable dataset (imports torch)."""

from __future__ import annotations

import os
from typing import Any

import torch.utils.data


def _as_tensor(value: Any) -> Any:
    """A numpy array as a tensor sharing its memory; times (torch has no
    datetime type) as int64 counts of their unit (nanoseconds since 1970
    for CF times); strings stay numpy arrays."""
    if value.dtype.kind in "fiub":
        return torch.from_numpy(value)
    if value.dtype.kind in "mM":
        return torch.from_numpy(value.view("int64"))
    return value


def _as_tensors(batch: dict) -> dict:
    out = {}
    for key, value in batch.items():
        if isinstance(value, dict):
            out[key] = {k: _as_tensor(v) for k, v in value.items()}
        else:
            out[key] = _as_tensor(value)
    return out


class TorchWindowLoader(torch.utils.data.IterableDataset):
    """A window loader as a PyTorch iterable dataset of tensors; in a
    DataLoader worker, that worker's share (``WindowLoader.torch``)."""

    def __init__(self, loader: Any) -> None:
        super().__init__()
        self.loader = loader

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        if info is None:
            loader = self.loader
        elif self.loader._pid != os.getpid():
            # Inherited by fork: its threads (and the engine's) stayed in
            # the parent.
            raise RuntimeError(
                "a zarrfusion loader cannot run in a DataLoader worker started by fork (its threads "
                "stay in the parent process); pass multiprocessing_context='spawn' or 'forkserver'"
            )
        else:
            # Unpickled in this worker's process: its share of the epoch.
            loader = self.loader._for_worker(info.id, info.num_workers)
        return (_as_tensors(b) for b in loader)

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

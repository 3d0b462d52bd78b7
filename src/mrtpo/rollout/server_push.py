"""Weight pushes to a vLLM server: snapshot files and the RL routes.

``WeightPushes`` is the part of ``VLLMServerEngine`` (``mrtpo.rollout.vllm_server``) that
sends the policy's weights after an update. Every training process walks the weights in the
same buckets (gathering FSDP shards is a collective); rank 0 writes each bucket as a
safetensors file (``write_snapshot``) into a folder the server also reads, and calls
``/start_weight_update``, ``/update_weights`` (the file names), ``/finish_weight_update``
(the new version) and ``/reset_prefix_cache``. The server's ``mrtpo_file`` backend
(``mrtpo.rollout.vllm_file_transfer``) reads the files.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from mrtpo.rollout.server_checks import VLLMServerError
from mrtpo.rollout.server_client import RequestFailed, ServerClient
from mrtpo.rollout.server_process import BACKEND
from mrtpo.rollout.weight_sync import SyncStats, buckets, exported_weights, gathered
from mrtpo.safe_files import make_dirs, refuse_unsafe


def _ranks() -> tuple[int, int]:
    """(rank, world size) of the training processes; (0, 1) without torch.distributed."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _from_rank0(value: Any) -> Any:
    """``value`` as rank 0 has it, on every rank (a collective)."""
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _text(error: BaseException | None) -> str | None:
    return None if error is None else f"{error}"


def _own_storage(tensors: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """CPU, contiguous tensors, a copy where two share memory (safetensors refuses those:
    a tied ``lm_head.weight`` is ``embed_tokens.weight``)."""
    seen: set[int] = set()
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        yield name, t


def write_snapshot(folder: Path, index: int, tensors: Sequence[tuple[str, torch.Tensor]]) -> str:
    """One bucket of a push as ``folder/bucket-<index>.safetensors``; returns the file name.

    The file is written beside its final name and renamed into place (a link there is
    refused, never written through). ``folder`` is the engine's own (``mkdtemp``: only this
    user can add names to it), and the file lives until the next push, so it is not fsynced:
    the server reads it at once (measured on a 119 MB model: a push took 0.5-0.7 s, against
    0.9-1.5 s with an fsynced write of the serialized bytes)."""
    from safetensors.torch import save_file

    name = f"bucket-{index:05d}.safetensors"
    path = folder / name
    refuse_unsafe(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        save_file(dict(_own_storage(dict(tensors))), tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return name


class WeightPushes:
    """``sync_weights`` of ``VLLMServerEngine`` (which sets the attributes named here)."""

    weight_version: int
    sync_bucket_bytes: int
    last_sync: SyncStats | None
    _push_dtype: torch.dtype | None
    _root: Path | None
    _pushes: Path | None

    def start(self) -> ServerClient:
        raise NotImplementedError

    def _failure(self, what: str, exc: RequestFailed) -> Exception:
        raise NotImplementedError

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Push ``model``'s weights (LoRA merged, FSDP shards gathered) as one new version.

        Every training process walks the weights in the same buckets (gathering shards is a
        collective); rank 0 writes and pushes them, then tells the others how it went, so no
        rank samples before the server holds the new version."""
        client = self.start()
        rank, world = _ranks()
        t0 = time.perf_counter()
        version = self.weight_version + 1
        files: list[str] = []
        count = nbytes = 0
        error: Exception | None = None
        with exported_weights(model) as pairs:
            for i, group in enumerate(buckets(pairs, self.sync_bucket_bytes)):
                tensors = gathered(group, self._push_dtype)
                count += len(tensors)
                nbytes += sum(t.numel() * t.element_size() for _, t in tensors)
                if rank == 0 and error is None:
                    try:
                        files.append(self._write(version, i, tensors))
                    except Exception as exc:  # keep gathering with the other ranks
                        error = exc
                del tensors
        if rank == 0 and error is None:
            try:
                self._post_push(client, files, version)
            except Exception as exc:
                error = exc
        if world > 1:
            message = _from_rank0(_text(error))
            if error is None and message is not None:
                raise VLLMServerError(f"rank 0's weight push failed: {message}")
        if error is not None:
            raise error
        if self._pushes is not None:
            shutil.rmtree(self._pushes / f"v{self.weight_version:06d}", ignore_errors=True)
        self.weight_version = version
        self.last_sync = SyncStats(BACKEND, count, nbytes, time.perf_counter() - t0)

    def _write(self, version: int, index: int, tensors: list[tuple[str, torch.Tensor]]) -> str:
        """One snapshot file of push ``version``; its name relative to the server's folder."""
        assert self._pushes is not None and self._root is not None
        folder = self._pushes / f"v{version:06d}"
        make_dirs(folder, self._pushes)
        name = write_snapshot(folder, index, tensors)
        return str((folder / name).relative_to(self._root))

    def _post_push(self, client: ServerClient, files: list[str], version: int) -> None:
        """The RL routes of one push. A refused push is closed on the server (a second
        ``/finish_weight_update``), so that the server can take the next one."""
        what = f"the weight push of version {version}"
        try:
            client.post("/start_weight_update")
            client.post("/update_weights", {"update_info": {"files": files}})
            client.post("/finish_weight_update", {"weight_version": str(version)})
            client.post("/reset_prefix_cache")
        except RequestFailed as exc:
            if exc.kind == "refused":
                with contextlib.suppress(RequestFailed):
                    client.post("/finish_weight_update", timeout_s=60)
            raise self._failure(what, exc) from None

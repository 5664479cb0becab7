"""Reading a crafted checkpoint runs nothing from it: the DCP metadata goes through an allowlisting
unpickler and byte items through torch's weights-only one. Each payload is first shown to be
live (the plain unpickler runs it), then shown to be refused, with nothing run."""

import io
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo

from loong_ckpt.mcore_io import read_metadata
from loong_ckpt.safe_load import UnsafeCheckpointError, read_dcp_metadata, vet_checkpoint


class Payload:
    """Unpickling it calls os.mkdir(marker): proof that code from the file ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def crafted_metadata(marker) -> bytes:
    return pickle.dumps({"state_dict_metadata": Payload(marker)})


def crafted_item(marker) -> bytes:
    buf = io.BytesIO()
    torch.save([Payload(marker)], buf)
    return buf.getvalue()


@pytest.fixture
def checkpoint(tmp_path):
    """A real DCP checkpoint with a tensor and a byte item (megatron stores a ShardedObject, e.g.
    the RNG states, as the bytes of ``torch.save``)."""
    path, item = tmp_path / "ckpt", io.BytesIO()
    torch.save([{"cpu": torch.get_rng_state()}], item)
    item.seek(0)
    dcp.save({"w": torch.arange(6.0), "rng_state": item}, checkpoint_id=path, no_dist=True)
    return path


def test_genuine_checkpoint_reads(checkpoint):
    assert "w" in read_dcp_metadata(checkpoint).state_dict_metadata
    assert vet_checkpoint(checkpoint) == 1
    assert set(read_metadata(checkpoint)) == {"w"}


def test_crafted_metadata_is_refused_and_runs_nothing(checkpoint, tmp_path):
    pickle.loads(crafted_metadata(tmp_path / "control"))
    assert (tmp_path / "control").is_dir(), "the payload is live under the plain unpickler"
    marker = tmp_path / "pwned"
    (checkpoint / ".metadata").write_bytes(crafted_metadata(marker))
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: refers to posix\.mkdir"):
        read_dcp_metadata(checkpoint)
    with pytest.raises(UnsafeCheckpointError):
        read_metadata(checkpoint)  # what loong-convert reads
    assert not marker.exists()


def test_crafted_byte_item_is_refused_and_runs_nothing(checkpoint, tmp_path):
    torch.load(io.BytesIO(crafted_item(tmp_path / "control")), weights_only=False)
    assert (tmp_path / "control").is_dir(), "the payload is live under torch.load(weights_only=False)"
    marker = tmp_path / "pwned"
    md = read_dcp_metadata(checkpoint)
    index = next(i for i in md.storage_data if i.fqn == "rng_state")
    data_file = checkpoint / md.storage_data[index].relative_path
    payload = crafted_item(marker)
    offset = data_file.stat().st_size
    with open(data_file, "ab") as f:
        f.write(payload)
    md.storage_data[index] = _StorageInfo(md.storage_data[index].relative_path, offset, len(payload))
    (checkpoint / ".metadata").write_bytes(pickle.dumps(md))  # only allowed classes: the metadata passes
    with pytest.raises(UnsafeCheckpointError, match=r"item rng_state\): refused by the weights-only unpickler"):
        vet_checkpoint(checkpoint)
    assert not marker.exists()

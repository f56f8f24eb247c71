"""Programmatic dependent launch is a launch option only where it exists: never off CUDA, under the Triton
interpreter (whose kernels must not be asked for it) or before Hopper, and FLASHNEXT_PDL=0 turns it off."""
import torch

from flashnext.ops import pdl


def test_no_pdl_off_cuda_or_when_switched_off(monkeypatch):
    assert pdl.launch_options(torch.device("cpu")) == {"PDL": False}
    # a Hopper GPU and a Triton that has PDL, as the device would answer them
    monkeypatch.setattr(pdl, "_TRITON_HAS_PDL", True)
    monkeypatch.setattr(pdl, "compute_capability", lambda device: (9, 0))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("FLASHNEXT_PDL", "1")
    cuda = torch.device("cuda")
    assert pdl.launch_options(cuda) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setenv("FLASHNEXT_PDL", "0")
    assert not pdl.enabled(cuda) and pdl.launch_options(cuda) == {"PDL": False}
    monkeypatch.setenv("FLASHNEXT_PDL", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.enabled(cuda)
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(pdl, "compute_capability", lambda device: (8, 0))
    assert not pdl.enabled(cuda)

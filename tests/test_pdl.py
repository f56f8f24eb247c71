"""Programmatic dependent launch is a launch option only where it exists: never off CUDA or under the Triton
interpreter (whose kernels must not be asked for it), and FLASHNEXT_PDL=0 turns it off."""
import torch

from flashnext.ops import pdl


def test_no_pdl_off_cuda_or_when_switched_off(monkeypatch):
    assert pdl.launch_options(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setenv("FLASHNEXT_PDL", "0")
    assert not pdl.enabled(torch.device("cuda"))          # decided before the device is asked about
    monkeypatch.setenv("FLASHNEXT_PDL", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.enabled(torch.device("cuda"))

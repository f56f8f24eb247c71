"""Flash-Next hyper-connections: the residual is `hc_count` streams side by side ([N, hc·H]).

Around a block: a grouped zero-centred RMSNorm per stream, a low-rank sigmoid mixer that weights each
normed stream, and the mean over streams as the block input. After the block every stream adds
2·sigmoid(W·xn / hc) × the block output to its *un-normalised* self. The final mixer (no injection)
reduces the streams to the hidden size before lm_head.
"""
import torch
from torch import nn

from flashnext.models.layers.norms import ZeroCenteredRMSNorm
from flashnext.ops.hyper_connection import PendingInjection, hc_inject, hc_mix, hc_mix_injected
from flashnext.weights.config import ModelConfig


class HyperConnection(nn.Module):
    def __init__(self, cfg: ModelConfig, with_injection: bool = True):
        super().__init__()
        self.hc = cfg.hc_count
        self.hidden = cfg.hidden_size
        width = cfg.hc_hidden_size
        self.hc_norm = ZeroCenteredRMSNorm(width, eps=cfg.rms_norm_eps, group_size=cfg.hidden_size)
        self.input_mix_weight_down = nn.Linear(width, cfg.hc_lowrank, bias=False)
        self.input_mix_weight_up = nn.Linear(cfg.hc_lowrank, width, bias=False)
        self.block_inject_weight = nn.Linear(width, self.hc, bias=False) if with_injection else None

    def mix(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """h [N, hc·H] → (block input [N, H], injection weights [N, hc] or None); the math is ops.hyper_connection's
        reference, fused into two kernels for decode-sized batches on the GPU."""
        inject = None if self.block_inject_weight is None else self.block_inject_weight.weight
        return hc_mix(h, self.hc_norm.weight, self.input_mix_weight_down.weight, self.input_mix_weight_up.weight,
                      inject, self.hc, self.hidden, self.hc_norm.eps)

    def decode_mix(self, h: torch.Tensor | PendingInjection) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """mix for the decode step, whose streams usually come with the previous block's injection still pending
        (its output and weights): → (block input, injection weights or None, the streams after the injection).
        The mix's first kernel does the injection: one launch fewer per block."""
        if not isinstance(h, PendingInjection):
            return (*self.mix(h), h)
        inject = None if self.block_inject_weight is None else self.block_inject_weight.weight
        return hc_mix_injected(h, self.hc_norm.weight, self.input_mix_weight_down.weight,
                               self.input_mix_weight_up.weight, inject, self.hc, self.hidden, self.hc_norm.eps)

    @staticmethod
    def inject(h: torch.Tensor, block_output: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return hc_inject(h, block_output, weights)

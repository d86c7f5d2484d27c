"""Linear layers on oneDNN weights packed once per weight version (CPU, bf16 and fp16).

On a CPU, torch runs a bf16/fp16 `F.linear` through oneDNN, and every call pays to lay
the weight out for the matrix unit (AMX tiles or AVX-512 bf16 blocks). The engine calls
the same weights thousands of times per version, so it packs each linear weight once
(`torch.ops.mkldnn._reorder_linear_weight`, the packing Inductor's CPU freezing uses) and
runs the layer on the packed copy (`torch.ops.mkldnn._linear_pointwise`). Measured on 2
cores of a Xeon with AMX, bf16, SmolLM2-135M's shapes: 1.2-1.4x per call at 128 rows and
about 2x at 1-16 rows, with the same numbers out (bias-free layers bit for bit; a bias is
added in fp32 inside the kernel, within a rounding of the unfused add).

The cost is memory and time per weight version: the packed copies sit beside the weights
(as large as the linear weights: 256 MiB for SmolLM2-135M, its tied head included), and
packing reads every weight once at each load, swap and resume (0.07-0.16 s for
SmolLM2-135M on those cores, against 0.2-0.6 s to read its file). fp32 stays on torch's own
kernels (no gain measured there), and so does every other device.

Tiny layers stay on torch's kernels too: under MIN_WEIGHT elements torch takes a path
without oneDNN at one row (a 64x64 bf16 layer: 4.5 us against 23 us packed, on that Xeon),
while every shape measured from 64x256 up ran faster packed (1.1-1.8x at 1 row).

`AREAL_ENGINE_PACKED_LINEAR=off` turns the packing off ("auto", the default, packs where
it applies).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

logger = logging.getLogger(__name__)

ENV = "AREAL_ENGINE_PACKED_LINEAR"
HALF = (torch.bfloat16, torch.float16)
ROWS_HINT = 128  # oneDNN's packing takes a typical row count; any row count runs on it
MIN_WEIGHT = 64 * 256  # elements of the smallest weight packed (see above)


def wanted(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why packing does not apply to a model on `device` in `dtype` (None: it does)."""
    choice = os.environ.get(ENV, "auto")
    if choice not in ("auto", "off"):
        raise ValueError(f"{ENV} must be auto or off, got {choice!r}")
    if choice == "off":
        return f"{ENV}=off"
    if device.type != "cpu" or dtype not in HALF:
        return f"{device.type} {dtype}: torch's own kernels"
    if not torch.backends.mkldnn.is_available():
        return "this torch has no oneDNN"
    supported = (
        torch.ops.mkldnn._is_mkldnn_bf16_supported()
        if dtype == torch.bfloat16
        else torch.ops.mkldnn._is_mkldnn_fp16_supported()
    )
    return None if supported else f"oneDNN has no native {dtype} on this CPU"


def _packed_forward(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, layer.bias, "none", [], "")


class PackedLinears:
    """The packed weights of every linear layer of `module` (see the module docstring).
    `refresh()` packs the weights the layers hold now and routes their forward to the
    packed copies; `drop()` frees the copies and restores torch's forward."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.layers = [
            m
            for m in module.modules()
            if isinstance(m, torch.nn.Linear) and m.weight.numel() >= MIN_WEIGHT
        ]
        self.problem: str | None = None  # why the layers run unpacked, once known
        self.active = False

    def refresh(self) -> None:
        """Pack the live weights (after a load or swap); on the first failure the layers
        stay on torch's kernels for good, said once in the log."""
        if not self.layers:
            self.problem = f"every weight under {MIN_WEIGHT} elements"
        if self.problem is not None:
            return
        weight = self.layers[0].weight
        self.problem = wanted(weight.device, weight.dtype)
        if self.problem is not None:
            return
        try:
            with torch.inference_mode():
                for layer in self.layers:
                    packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight, ROWS_HINT)
                    layer.packed_weight = packed
                    layer.forward = functools.partial(_packed_forward, layer)
                self._check(self.layers[0])
        except (RuntimeError, ValueError) as exc:
            self.problem = f"packing failed ({type(exc).__name__}: {exc})"
            logger.warning("linear layers run unpacked: %s", self.problem)
            self.drop()
            return
        self.active = True

    @staticmethod
    def _check(layer: torch.nn.Linear) -> None:
        """The packed layer against torch's on a few rows; a mismatch past bf16's
        rounding raises ValueError."""
        x = torch.randn(3, layer.in_features, dtype=layer.weight.dtype)
        got = layer(x).float()
        want = torch.nn.functional.linear(x, layer.weight, layer.bias).float()
        scale = want.abs().max().item() + 1e-6
        if (got - want).abs().max().item() > 0.02 * scale:
            raise ValueError("the packed layer's output differs from torch's")

    def drop(self) -> None:
        """Free the packed copies (the weights are released, or packing failed)."""
        for layer in self.layers:
            layer.__dict__.pop("forward", None)
            layer.__dict__.pop("packed_weight", None)
        self.active = False

    @property
    def nbytes(self) -> int:
        """Bytes held by the packed copies (about those of the linear weights)."""
        if not self.active:
            return 0
        return sum(layer.weight.nbytes for layer in self.layers)

    def describe(self) -> str:
        if self.active:
            return f"{len(self.layers)} linear layers on packed oneDNN weights"
        return "linear layers on torch's kernels" + (f" ({self.problem})" if self.problem else "")

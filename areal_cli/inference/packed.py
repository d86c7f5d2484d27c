"""Linear layers on weights prepared once per weight version (CPU, bf16 and fp16).

On a CPU, torch runs a bf16/fp16 `F.linear` through oneDNN, and every call pays to lay
the weight out for the matrix unit (AMX tiles or AVX-512 bf16 blocks). The engine calls
the same weights thousands of times per version, so it prepares each linear weight once
and runs the layer on the prepared copy, in one of two ways.

- **packed**, where oneDNN has native bf16/fp16 on this CPU: the weight packed for the
  matrix unit (`torch.ops.mkldnn._reorder_linear_weight`, the packing Inductor's CPU
  freezing uses), run by `torch.ops.mkldnn._linear_pointwise`. Measured on 2 cores of a
  Xeon with AMX, bf16, SmolLM2-135M's shapes: 1.2-1.4x per call at 128 rows and about 2x
  at 1-16 rows, with the same numbers out (bias-free layers bit for bit; a bias is added
  in fp32 inside the kernel, within a rounding of the unfused add).
- **widened**, where it has not (AVX2 only: bf16 is emulated there): an fp32 copy of the
  weight (its values exactly, bf16 and fp16 widen without loss), run by torch's fp32
  GEMM on the widened input, the output rounded back to the model's dtype. A product of
  two bf16 values is exact in fp32 and the emulated kernel also sums in fp32, so the
  numbers differ from it by the order of the sums only. Measured on 2 cores of an AMD
  EPYC (Milan, AVX2), SmolLM2-135M's shapes at 128 rows: 4-7x per call.

The cost is memory and time per weight version: the prepared copies sit beside the
weights (packed: as large as the linear weights, 256 MiB for SmolLM2-135M with its tied
head; widened: twice that), and preparing reads every weight once at each load, swap and
resume (packing SmolLM2-135M took 0.07-0.16 s on the Xeon, against 0.2-0.6 s to read its
file). fp32 models stay on torch's own kernels (nothing to gain), and so does every other
device.

Tiny layers stay on torch's kernels too: under MIN_WEIGHT elements torch takes a path
without oneDNN at one row (a 64x64 bf16 layer: 4.5 us against 23 us packed, on that Xeon),
while every shape measured from 64x256 up ran faster packed (1.1-1.8x at 1 row).

`AREAL_ENGINE_PACKED_LINEAR` picks: "auto" (the default) packs where oneDNN is native and
widens elsewhere, "widen" widens on any CPU (to compare, and to test that path anywhere),
"off" runs torch's kernels.
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
MIN_WEIGHT = 64 * 256  # elements of the smallest weight prepared (see above)
CHOICES = ("auto", "widen", "off")
COPIES = ("packed_weight", "wide_weight", "wide_bias", "forward")  # set on a prepared layer


def choose(device: torch.device, dtype: torch.dtype) -> tuple[str | None, str]:
    """How linear layers on `device` in `dtype` are prepared: ("packed" or "widened",
    why), or (None, why they are not)."""
    choice = os.environ.get(ENV, "auto")
    if choice not in CHOICES:
        raise ValueError(f"{ENV} must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice == "off":
        return None, f"{ENV}=off"
    if device.type != "cpu" or dtype not in HALF:
        return None, f"{device.type} {dtype}: torch's own kernels"
    if choice == "widen":
        return "widened", f"{ENV}=widen"
    native = torch.backends.mkldnn.is_available() and (
        torch.ops.mkldnn._is_mkldnn_bf16_supported()
        if dtype == torch.bfloat16
        else torch.ops.mkldnn._is_mkldnn_fp16_supported()
    )
    if native:
        return "packed", f"oneDNN has native {dtype} here"
    return "widened", f"no native {dtype} on this CPU"


def _packed_forward(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, layer.bias, "none", [], "")


def _widened_forward(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    out = torch.nn.functional.linear(x.float(), layer.wide_weight, layer.wide_bias)
    return out.to(x.dtype)


class PackedLinears:
    """The prepared weights of every linear layer of `module` (see the module docstring).
    `refresh()` prepares the weights the layers hold now and routes their forward to the
    copies; `drop()` frees the copies and restores torch's forward."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.layers = [
            m
            for m in module.modules()
            if isinstance(m, torch.nn.Linear) and m.weight.numel() >= MIN_WEIGHT
        ]
        self.kind: str | None = None  # "packed" or "widened" once known
        self.problem: str | None = None  # why the layers run on torch's kernels, once known
        self.active = False

    def refresh(self) -> None:
        """Prepare the live weights (after a load or swap); on the first failure the
        layers stay on torch's kernels for good, said once in the log."""
        if not self.layers:
            self.problem = f"every weight under {MIN_WEIGHT} elements"
        if self.problem is not None:
            return
        if self.kind is None:
            weight = self.layers[0].weight
            self.kind, why = choose(weight.device, weight.dtype)
            if self.kind is None:
                self.problem = why
                return
        try:
            with torch.inference_mode():
                for layer in self.layers:
                    self._prepare(layer)
                self._check(self.layers[0])
        except (RuntimeError, ValueError) as exc:
            self.problem = f"{self.kind} weights failed ({type(exc).__name__}: {exc})"
            logger.warning("linear layers run on torch's kernels: %s", self.problem)
            self.drop()
            return
        self.active = True

    def _prepare(self, layer: torch.nn.Linear) -> None:
        if self.kind == "packed":
            layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(layer.weight, ROWS_HINT)
            layer.forward = functools.partial(_packed_forward, layer)
            return
        layer.wide_weight = layer.weight.float()
        layer.wide_bias = None if layer.bias is None else layer.bias.float()
        layer.forward = functools.partial(_widened_forward, layer)

    @staticmethod
    def _check(layer: torch.nn.Linear) -> None:
        """The prepared layer against torch's on a few rows; a mismatch past bf16's
        rounding raises ValueError."""
        x = torch.randn(3, layer.in_features, dtype=layer.weight.dtype)
        got = layer(x).float()
        want = torch.nn.functional.linear(x, layer.weight, layer.bias).float()
        scale = want.abs().max().item() + 1e-6
        if (got - want).abs().max().item() > 0.02 * scale:
            raise ValueError("the prepared layer's output differs from torch's")

    def drop(self) -> None:
        """Free the copies (the weights are released, or preparing them failed)."""
        for layer in self.layers:
            for name in COPIES:
                layer.__dict__.pop(name, None)
        self.active = False

    @property
    def nbytes(self) -> int:
        """Bytes held by the copies (packed: about those of the linear weights; widened:
        twice those of bf16/fp16 weights)."""
        if not self.active:
            return 0
        if self.kind == "packed":
            return sum(layer.weight.nbytes for layer in self.layers)
        return sum(
            layer.wide_weight.nbytes + (0 if layer.wide_bias is None else layer.wide_bias.nbytes)
            for layer in self.layers
        )

    def describe(self) -> str:
        if self.active:
            weights = "packed oneDNN" if self.kind == "packed" else "fp32 copies of their"
            return f"{len(self.layers)} linear layers on {weights} weights"
        return "linear layers on torch's kernels" + (f" ({self.problem})" if self.problem else "")

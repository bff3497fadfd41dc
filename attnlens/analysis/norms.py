"""Norms frozen at a run's own statistics: linear maps, so what passes through them can be split into pieces.

An RMSNorm `w * x / rms(x)` or a LayerNorm `w * (x - mean(x)) / std(x) + b` is linear in `x` once its per-position
scale (`rms` or `std`) is held at the value the run computed: the pieces of the residual then add up, through the
norm, to its output exactly. `NormForm.of(module)` finds which form a module computes by probing it on random input
(outside any trace) against each candidate; `NormForm` then gives the frozen scale of a run's input, the direction a
read-out of the output pulls back to, and the check that the frozen form reproduces the run's own output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: The forms tried, in order: (name, centred, how the weight enters).
FORMS = (
    ("RMSNorm", False, "weight"),
    ("RMSNorm with 1 + weight (Gemma)", False, "one_plus"),
    ("RMSNorm without weight", False, "none"),
    ("LayerNorm", True, "weight"),
    ("LayerNorm without weight", True, "none"),
)


def _eps(module) -> float:
    for name in ("eps", "variance_epsilon", "epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    return 1e-6


@dataclass(frozen=True)
class NormForm:
    """A norm as `gain * centre?(x) / scale(x) + bias`, `scale` the per-position root mean square (of the centred
    input where `centred`)."""

    name: str  #: which form, for notes ("RMSNorm with 1 + weight (Gemma)")
    module: str  #: the module's class, for messages
    centred: bool
    gain: torch.Tensor  #: [hidden], float32: the weight as it multiplies (1 + w on Gemma; ones without a weight)
    bias: torch.Tensor | None  #: [hidden] float32, or None
    eps: float
    enters: str = "weight"  #: how the weight enters: "weight", "one_plus" (1 + w) or "none"

    @classmethod
    def of(cls, module: torch.nn.Module, hidden: int, weight: torch.Tensor | None = None) -> NormForm | None:
        """The form `module` computes, found by running it on random input; None where no form matches. `weight` is
        its gain where the family names it otherwise (`Identities.norm_gain`); by default its `weight`."""
        weight = getattr(module, "weight", None) if weight is None else weight
        bias = getattr(module, "bias", None)
        if weight is not None and weight.dim() != 1:
            return None
        if bias is not None and (not torch.is_tensor(bias) or bias.dim() != 1):
            return None
        eps = _eps(module)
        parameter = weight if weight is not None else next(module.parameters(), None)
        device = parameter.device if parameter is not None else torch.device("cpu")
        dtype = parameter.dtype if parameter is not None else torch.float32
        x = torch.randn(2, 3, hidden, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=dtype)
        try:
            with torch.no_grad():
                out = module(x)
        except Exception:  # noqa: BLE001  (a module that is no plain norm of one tensor)
            return None
        out = out[0] if isinstance(out, tuple) else out
        if not torch.is_tensor(out) or out.shape != x.shape:
            return None
        for name, centred, enters in FORMS:
            if enters != "none" and weight is None:
                continue
            form = cls(
                name,
                type(module).__name__,
                centred,
                gain_of(weight, enters, hidden, device),
                None if bias is None else bias.detach().float(),
                eps,
                enters,
            )
            if _close(form.apply(x.float()), out.float(), dtype):
                return form
        return None

    def to(self, device) -> NormForm:
        from dataclasses import replace

        return replace(self, gain=self.gain.to(device), bias=None if self.bias is None else self.bias.to(device))

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        """The per-position scale of `x` [..., hidden] (float32), [..., 1]."""
        x = x.float()
        if self.centred:
            x = x - x.mean(-1, keepdim=True)
        return (x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()

    def apply(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """The norm of `x`, its scale frozen at `scale` (default: `x`'s own)."""
        scale = self.scale(x) if scale is None else scale
        centred = x - x.mean(-1, keepdim=True) if self.centred else x
        out = self.gain * centred / scale
        return out if self.bias is None else out + self.bias

    def pullback(self, direction: torch.Tensor) -> torch.Tensor:
        """The direction in the input's basis that reads, times 1 / scale, what `direction` reads of the output
        (bias left out): `direction . norm(x) == pullback(direction) . x / scale(x) + direction . bias`."""
        pulled = direction.float() * self.gain
        return pulled - pulled.mean(-1, keepdim=True) if self.centred else pulled

    def bias_term(self, direction: torch.Tensor) -> torch.Tensor:
        """`direction . bias` (zeros without a bias), per leading index of `direction`."""
        if self.bias is None:
            return torch.zeros(direction.shape[:-1], device=direction.device)
        return direction.float() @ self.bias.to(direction.device)


def gain_of(weight: torch.Tensor | None, enters: str, hidden: int, device) -> torch.Tensor:
    """What a norm multiplies by (float32, [hidden]), as its weight enters: the weight, 1 + weight (Gemma), or ones
    ("none", or no weight)."""
    if enters == "none" or weight is None:
        return torch.ones(hidden, device=device)
    return weight.detach().float() + (1.0 if enters == "one_plus" else 0.0)


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    from ..checks import TOLERANCE

    atol, rtol = TOLERANCE.get(dtype, TOLERANCE[torch.float32])
    return bool(torch.allclose(a, b, atol=atol * 10, rtol=rtol * 10))

"""The dtype names and the device choice, the same in every command.

Dtypes are written `bf16`, `fp16`, `fp32` everywhere (flags, config files, manifests);
`auto` means bf16 on CUDA and fp32 on CPU. The long torch names (`bfloat16`, `float16`,
`float32`) are accepted as aliases. torch is imported only by the functions that return
torch objects, so the CLIs can name the choices in `--help` without it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import click

from .errors import SettingError
from .findings import Finding

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("bf16", "fp16", "fp32")
AUTO = "auto"
DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}
_TORCH_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def dtype_name(name: str, allowed: Sequence[str] = (AUTO, *DTYPE_NAMES), *, flag: str = "--dtype") -> str:
    """The canonical name of `name` (an alias becomes its short name), or a SettingError."""
    short = DTYPE_ALIASES.get(str(name), str(name))
    if short not in allowed:
        raise SettingError(Finding("runtime.dtype-unknown", flag=flag, value=str(name), allowed=list(allowed)))
    return short


def resolve_dtype_name(name: str, device: Any) -> str:
    """`auto` -> bf16 on CUDA, fp32 elsewhere; any other name as its canonical name."""
    name = dtype_name(name)
    if name != AUTO:
        return name
    return "bf16" if str(getattr(device, "type", device)).startswith("cuda") else "fp32"


def torch_dtype(name: str, device: Any = "cpu") -> torch.dtype:
    """The torch dtype of a dtype name (`auto` resolved for `device`)."""
    import torch

    return getattr(torch, _TORCH_NAMES[resolve_dtype_name(name, device)])


class DtypeChoice(click.Choice):
    """click choice of dtype names that also accepts the long aliases (normalized to short)."""

    def __init__(self, allowed: Sequence[str] = (AUTO, *DTYPE_NAMES)) -> None:
        super().__init__(list(allowed))

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        return super().convert(DTYPE_ALIASES.get(str(value), value), param, ctx)


def resolve_device(device: str | None = None) -> torch.device:
    """The torch device a command runs on.

    None or `auto`: this process's GPU when CUDA is available (under torchrun each process of
    a host takes GPU LOCAL_RANK, modulo the visible ones), else the CPU. `cuda` without an
    index is that same GPU. A CUDA device when CUDA is not available is a SettingError.
    """
    import torch

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device in (None, "", AUTO):
        if not torch.cuda.is_available():
            return torch.device("cpu")
        device = "cuda"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise SettingError(Finding("runtime.device-invalid", flag="--device", value=str(device), error=str(e))) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise SettingError(Finding("runtime.cuda-unavailable", flag="--device", value=str(device)))
        if dev.index is None:
            dev = torch.device("cuda", local_rank % torch.cuda.device_count())
    return dev

"""Loads the compiled extensions and registers their FFI targets with XLA at import."""

from __future__ import annotations

import importlib

import jax
from jaxlib import xla_client  # the traits' enum: jax.ffi passes traits on but does not name them


_MISSING: dict[str, str] = {}  # extension -> why it is not there, for the error messages


def _load(module: str):
    try:
        return importlib.import_module(f"jax_sprnn.{module}")
    except ImportError as error:  # not built (no compiler / nvcc), or built but unloadable
        not_built = isinstance(error, ModuleNotFoundError) and error.name == f"jax_sprnn.{module}"
        _MISSING[module] = "was not built" if not_built else f"failed to load ({error})"
        return None


def why_missing(module: str) -> str:
    """'was not built' or 'failed to load (...)' for an extension that did not import."""
    return _MISSING.get(module, "is loaded")


_cpu = _load("_sprnn_cpu")
_cuda = _load("_sprnn_cuda")

# The CUDA one-step targets launch the same kernel at every call and never sync: XLA may
# capture them in its command buffers (CUDA graphs) with the rest of a loop body.
COMMAND_BUFFER_TARGETS = frozenset(_cuda.command_buffer_targets()) if _cuda else frozenset()

for _module, _platform in ((_cpu, "cpu"), (_cuda, "CUDA")):
    if _module is not None:
        for _name, _capsule in _module.registrations().items():
            _traits = ({"traits": xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE}
                       if _name in COMMAND_BUFFER_TARGETS else {})
            jax.ffi.register_ffi_target(_name, _capsule, platform=_platform, **_traits)

CPU_TARGETS = frozenset(_cpu.registrations()) if _cpu is not None else frozenset()
CUDA_TARGETS = frozenset(_cuda.registrations()) if _cuda is not None else frozenset()
cuda_module = _cuda


def require_cpu_extension():
    if _cpu is None:
        raise ImportError(
            f"jax_sprnn's C++ extension (_sprnn_cpu) {why_missing('_sprnn_cpu')}. Install the "
            "package with `pip install .` (see README.md and BUILD_NOTES.md) instead of "
            "importing it from the source tree.")
